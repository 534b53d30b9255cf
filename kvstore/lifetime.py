"""How kvtier's commands and the processes they start end together.

`on_sigterm`: SIGTERM becomes `Terminated`, raised where the main thread is, so that what a
command started (a demo's workers and store) is stopped by the `with`/`finally` blocks it
unwinds; Python's default ended the process on the spot and left them running. Inside
`teardown()` (stopping those processes) it waits until the block is done, so it cannot cut
a stop short; a second SIGTERM ends the process at once (the default action), its children
then told by the kernel (below).

`child_env` / `exit_with_parent`: a child that must not outlive its launcher asks the
kernel for SIGTERM when the launcher ends, however it ends (SIGKILL too), through
KVTIER_PARENT_PID (kvstore.env).
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
from typing import Iterator

from kvstore.env import PARENT

log = logging.getLogger("kvtier")

PR_SET_PDEATHSIG = 1


class Terminated(SystemExit):
    """SIGTERM. A SystemExit, so that an event loop running a callback lets it through."""


_held = 0  # teardown blocks running (main thread: signal handlers run there)
_pending = False  # a SIGTERM came during one


def _terminate(signum, frame) -> None:
    global _pending
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one ends the process at once
    if _held:
        _pending = True
        return
    raise Terminated(128 + signum)


@contextlib.contextmanager
def on_sigterm() -> Iterator[None]:
    """SIGTERM raises Terminated inside the block (main thread only; elsewhere nothing
    changes); the handler before it is put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    global _pending
    before = signal.signal(signal.SIGTERM, _terminate)
    _pending = False
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


_noted: int | None = None  # a stop signal noted while a daemon was starting


def _note(signum, frame) -> None:
    global _noted
    _noted = signum


def defer_stop_signals() -> None:
    """SIGINT and SIGTERM are noted, not raised, until a daemon's event loop takes them over
    (`noted_stop`): raised during its imports, KeyboardInterrupt could land inside an
    extension's C++ initializer and abort the process (pybind11, "terminate called")."""
    signal.signal(signal.SIGINT, _note)
    signal.signal(signal.SIGTERM, _note)


def noted_stop() -> int | None:
    """The stop signal noted since `defer_stop_signals`, if any."""
    return _noted


@contextlib.contextmanager
def teardown() -> Iterator[None]:
    """Stopping what was started: a SIGTERM meanwhile is raised once the block is done.
    (Outside the main thread nothing changes: the handler interrupts only that one.)"""
    global _held, _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if not _held and _pending:
            _pending = False
            raise Terminated(128 + signal.SIGTERM)


def child_env() -> dict[str, str]:
    """Environment entries for a child that must end with this process. Only from the
    main thread: the kernel's parent-death signal follows the thread that started the
    child, and a helper thread may end long before the process does (from another thread
    the variable is blanked, so one this process inherited is not passed on)."""
    if threading.current_thread() is not threading.main_thread():
        return {PARENT: ""}
    return {PARENT: str(os.getpid())}


def exit_with_parent() -> None:
    """In a child started with `child_env`: have the kernel send this process SIGTERM when
    its parent ends. The variable is taken out of the environment, so what this process
    starts does not inherit it. A value that names a live process other than the parent
    (a stray variable in a user's environment, a wrapper between launcher and child) is
    warned about and ignored; a parent already gone ends this process now."""
    value = os.environ.pop(PARENT, "")
    if not value.isdigit() or not sys.platform.startswith("linux"):
        return
    parent = int(value)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if os.getppid() == parent:
        return
    try:
        os.kill(parent, 0)
    except ProcessLookupError:  # it ended before the signal was asked for
        log.warning("the process that started this one (pid %d) has ended: stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    except PermissionError:
        pass
    libc.prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)
    log.warning("%s=%d is not this process's parent (pid %d): ignored", PARENT, parent,
                os.getppid())
