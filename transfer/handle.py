"""`Transfer`: the handle `Agent.post` returns; poll it, wait on it, release it."""
from __future__ import annotations

import threading

from .errors import Fault, TransferError
from .types import Op, State


class Transfer:
    """One posted READ/WRITE. Backends finish it with `_done_part` / `_fail`, exactly once.

    A transfer may be split into parts (e.g., one per connection); it is DONE when every part
    is, FAILED once any part has failed and every other part has finished (landed, or
    failed too): until then the others may still be moving bytes to or from the caller's
    memory, and the handle stays PENDING. A failed transfer never becomes DONE.
    """

    __slots__ = ("name", "op", "peer", "num_descs", "nbytes", "_state", "_error", "_event",
                 "_lock", "_parts")

    def __init__(self, name: str, op: Op, peer: str, num_descs: int, nbytes: int):
        self.name = name
        self.op = op
        self.peer = peer
        self.num_descs = num_descs
        self.nbytes = nbytes
        self._state = State.PENDING
        self._error: TransferError | None = None
        self._event: threading.Event | None = None  # made only if someone has to block
        self._lock = threading.Lock()
        self._parts = 1

    def __repr__(self) -> str:
        return f"Transfer({self.name}, {self._state.value}, {self.num_descs} descs)"

    @property
    def state(self) -> State:
        return self._state

    def poll(self) -> State:
        """PENDING or DONE; raises the TransferError if the transfer failed."""
        if self._state is State.FAILED:
            raise self._error
        if self._state is State.RELEASED:
            raise TransferError(Fault.INVALID, "polled after release", self.name)
        return self._state

    def wait(self, timeout: float | None = None) -> None:
        """Block until DONE; TransferError on failure or when `timeout` seconds pass first."""
        with self._lock:
            if self._state is State.PENDING and self._event is None:
                self._event = threading.Event()
            event = self._event
        if event is not None and self._state is State.PENDING and not event.wait(timeout):
            raise TransferError(Fault.TIMEOUT, f"still pending after wait({timeout})", self.name)
        self.poll()

    def release(self) -> None:
        """Drop the handle. A PENDING transfer cannot be released: its data may still land."""
        with self._lock:
            if self._state is State.PENDING:
                raise TransferError(Fault.INVALID, "release() while still pending; wait first",
                                    self.name)
            self._state = State.RELEASED

    # backend side ---------------------------------------------------------------------------

    def _set_parts(self, parts: int) -> None:
        self._parts = parts

    def _unstarted(self, parts: int) -> None:
        """`parts` of those set will never start (posting them failed): no part of theirs
        will finish. The part whose post raised is the one the caller's `_fail` ends."""
        with self._lock:
            self._parts -= parts

    def _done_part(self) -> None:
        self._finish_part(None)

    def _fail(self, err: TransferError) -> None:
        """One part failed (the whole transfer, if it has one part)."""
        self._finish_part(err)

    def _finish_part(self, err: TransferError | None) -> None:
        with self._lock:
            if self._state is not State.PENDING:
                return
            if err is not None and self._error is None:  # (the first one is said)
                self._error = err if err.transfer == self.name else err.for_transfer(self.name)
            self._parts -= 1
            if self._parts > 0:
                return
            self._state = State.DONE if self._error is None else State.FAILED
            event = self._event
        if event is not None:
            event.set()
