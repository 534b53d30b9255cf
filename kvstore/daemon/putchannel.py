"""The daemon side of same-host puts with no request (the ring layout: kvstore.putring).

A local connection that sends PUTS becomes a put channel: the daemon creates its ring
(anonymous shared memory) and an eventfd doorbell, hands both over, and keeps the ring
stocked with granted DRAM slots. One thread (`Drainer`) waits on every channel's doorbell
with epoll and commits what each ring holds: it checks each record's slot against what it
granted that channel, binds and publishes the blocks (`TieredStore.commit_granted`), then
tops the grants up again. A FLUSH request drains its channel at once (read-your-writes for
the client's next request); closing the connection drains it a last time and gives every
slot it still held back.
"""
from __future__ import annotations

import logging
import os
import select
import threading
import time

from kvstore.daemon.namespaces import Hosted
from kvstore.grants import BATCH_SHARE, GRANTED_SHARE
from kvstore.logevery import LogEvery
from kvstore.putring import PutRing, fence, ring_bytes
from kvstore.tuning import background_thread
from transfer import ShmSegment

WARN_EVERY_S = 10.0  # a channel's ungranted records are logged at most this often
log = logging.getLogger("kvtier.puts")
RING_CAPACITY = 1024
GRANT_CAPACITY = 256
GRANT_BYTES = 64 << 20  # at most this much DRAM held in grants by one channel
MIN_GRANTING_SLOTS = 16  # a smaller arena grants nothing: every slot stays a request's
BATCH_HOLD_S = 1.0  # a batch bigger than the stock is granted ahead this long after the last
TOP_UP_STEP = 8  # the drainer tops a stock up once 1/8 of it is used, not after every put:
# each top-up is a make-room pass of the store, ~44 us of CPU for one slot, run cold
REVISIT_S = 0.001  # a ring whose pass committed records (its client is putting) is drained
# again this much later (epoll's resolution), left marked awake meanwhile (its puts ring
# nothing): drained again at once, the drainer chased a client putting back to back one
# record at a time, a core's worth of CPU (27 us of it per 256 KiB put, for ~25 us of put);
# now it takes what came meanwhile
REVISIT_SHARE = 4  # ...as long as its client's pace would use at most 1/4 of the channel's
# stock of grants meanwhile (else at once, as before: a client that ran out would FLUSH)


class PutChannel:
    def __init__(self, hosted: Hosted) -> None:
        self.hosted, self.store = hosted, hosted.store
        with hosted._count_lock:
            hosted.put_channels += 1
        self.segment = ShmSegment.anonymous(ring_bytes(RING_CAPACITY, GRANT_CAPACITY),
                                            "kvtier-putring")
        self.ring = PutRing(self.segment.array, RING_CAPACITY, GRANT_CAPACITY)
        self.doorbell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.granted: set[int] = set()  # granted to this channel and not yet committed
        self.batch = (0, 0.0)  # (a batch bigger than the stock the client puts, when last)
        self.lock = threading.Lock()
        self.closed = False
        self._ungranted = LogEvery(WARN_EVERY_S)  # drains that met ungranted records
        self._ignored = 0  # ungranted records since the last line
        self._pass_at = 0.0  # when the drainer's last pass over this ring began
        self._top_up()

    def fds(self) -> list[int]:
        """Descriptors for the client (send, then close): the ring (read-write), the bell."""
        return [self.segment.share_fd(writable=True), os.dup(self.doorbell)]

    def drain(self, want: int = 0) -> int:
        """Commit every record the client published; top the grants up (to at least `want`
        where the store allows it: see `_top_up`). How many were committed."""
        with self.lock:
            if self.closed:
                return 0
            hashes, slots = self.ring.peek()
            mine = [(h, s) for h, s in zip(hashes, slots) if s in self.granted]
            if len(mine) < len(hashes):
                self._ignored += len(hashes) - len(mine)
                if self._ungranted.due() is not None:  # (a client writing its ring's header
                    # made every drain log, 500 lines a second)
                    log.warning("a put channel named %d slots it was not granted (ignored)",
                                self._ignored)
                    self._ignored = 0
            if mine:
                self.granted.difference_update(s for _, s in mine)
                self.store.commit_granted([h for h, _ in mine], [s for _, s in mine])
            self.ring.consume(len(hashes))
            self._note_batch(want, len(mine))
            self._top_up(want)
            return len(mine)

    def drain_pass(self) -> bool:
        """The drainer's pass over this ring (its doorbell rang, a revisit, or the periodic
        one): drain. A pass that found nothing marks the ring asleep, so that its client's
        next record rings, and looks once more (a record whose client saw the ring awake
        is drained now). One that committed records (its client is putting), or saw more
        come, returns False: the ring stays marked awake, so its puts ring nothing, and the
        drainer comes back to it REVISIT_S later, after the other channels' turns (marked
        asleep after each pass, a client putting every ~30 us rang for every put or two
        and had its records drained one at a time). A client whose pace (the records of
        this pass over the time since the last one began) would use more than
        1/REVISIT_SHARE of its stock by then has its doorbell rung instead: the drainer
        comes back as soon as the other channels have had their turn."""
        if fence is None:  # (no fence: the mark stays asleep, set at creation, and every
            self.drain()  # publish rings)
            return True
        now = time.monotonic()
        since, self._pass_at = now - self._pass_at, now
        if not self._mark_asleep(False):
            return True
        got = self.drain()
        if not got and self._asleep_unless_more():
            return True
        if got * REVISIT_S * REVISIT_SHARE <= self.target() * since:
            return False
        with self.lock:
            if not self.closed:
                os.eventfd_write(self.doorbell, 1)
        return True

    def _asleep_unless_more(self) -> bool:
        """Mark the ring asleep, then look once more: True when it stays so (nothing more
        was published, or the channel is closed), False, marked awake again, when records
        wait."""
        with self.lock:
            if self.closed:
                return True
            self.ring.mark_asleep(True)
            fence()
            if not self.ring.waiting():
                return True
            self.ring.mark_asleep(False)
            return False

    def _mark_asleep(self, asleep: bool) -> bool:
        """Mark the ring (`PutRing.mark_asleep`), unless the channel is closed: False then
        (its memory goes with it)."""
        with self.lock:
            if not self.closed:
                self.ring.mark_asleep(asleep)
            return not self.closed

    def _note_batch(self, want: int, committed: int) -> None:
        """Remember a batch bigger than the stock (a FLUSH naming it) for as long as the
        client keeps putting that many at a time (BATCH_HOLD_S after the last): `_top_up`
        then grants such batches ahead. Granted only at a FLUSH, every such put paid a
        FLUSH round trip first: ~0.4 ms of a ~6 ms 4 MiB x16 put (a stock of 12 slots in
        a 192 MiB arena)."""
        size, _ = self.batch
        if want > self.target():
            self.batch = (want, time.monotonic())
        elif size and committed >= size:
            self.batch = (size, time.monotonic())

    def target(self) -> int:
        """How many granted slots this channel keeps in stock: enough for the client to put
        on through a drainer that a busy host leaves unscheduled for ~10 ms (GRANT_BYTES),
        yet, as grants are slots no other put can use, an equal part of a quarter of the
        namespace's DRAM (1/GRANTED_SHARE over all its channels; the store's ceiling for
        every grant together is half: see `_top_up`; an arena under MIN_GRANTING_SLOTS
        grants nothing: its clients put with a request, so a put request can use every
        slot). With 1/16 per channel, a 192 MiB arena of
        256 KiB blocks granted 48: under two busy processes the drainer fell that far
        behind in ~1% of puts, each of which waited a FLUSH (0.7-8 ms)."""
        hosted = self.hosted
        slots = hosted.dram.num_slots
        if slots < MIN_GRANTING_SLOTS:
            return 0
        share = slots // GRANTED_SHARE // max(1, hosted.put_channels)
        return min(GRANT_CAPACITY, GRANT_BYTES // hosted.ns.block_bytes, share)

    def _top_up(self, batch: int = 0) -> None:
        """Grant slots up to the channel's stock (`target`), or once up to `batch` (a FLUSH
        naming a batch bigger than the stock: its slots are written at once), as long as
        all grants together stay within 1/BATCH_SHARE of the DRAM tier (a batch over that,
        or an arena that grants nothing, is left to a put request). While the
        client keeps putting such batches (`_note_batch`), the drainer's top-ups keep two of
        them granted, within the same limit: the client copies into what is left of the
        stock while the drainer commits its last batch and grants the rest."""
        target = self.target()
        size, at = self.batch
        if not batch and time.monotonic() - at < BATCH_HOLD_S:
            batch = 2 * size  # the drainer's top-up: the batch being written and the next
        if target and batch > target:
            target = batch
        elif not batch and len(self.granted) > target - max(1, target // TOP_UP_STEP):
            return  # the drainer's top-up of a stock that is nearly whole: once it has
            # gone down a step (a FLUSH asking for slots is answered in full, as before)
        want = min(target - len(self.granted), self.ring.grant_room())
        if want > 0:
            # within the store's ceiling of half the DRAM, not the quarter the stocks share:
            # a channel's stock is its part of the quarter (`target`), but one stocked
            # before others opened keeps its larger stock until it puts (grants cannot be
            # taken back from a client), and an idle one never does; under the quarter,
            # every channel opened after it was granted nothing for as long (its puts ~10x
            # slower, by request)
            slots = self.store.grant_n(want, BATCH_SHARE)
            self.granted.update(slots)
            self.ring.push_grants(slots)

    def close(self, store: bool = True, give_back: bool = True) -> None:
        """The connection ended: mark the ring ended (`PutRing.mark_ended`: a client that
        publishes after this drain learns that its records may not be committed, and puts
        them by request), commit what is published, give every other slot back (once: a
        second call drains nothing and gives nothing back). `store` False: the namespace is
        being cleared (its store closes, taking every slot with it): only this channel's
        own descriptors and memory go. `give_back` False (the daemon is stopping, its
        client maybe mid-copy into a granted slot): the grants stay out of use until the
        store closes, so that no other put can be handed a slot that client still writes.
        A graceful stop told a client STORED for puts it published after the last drain,
        and lost them (the client saw nothing of the channel's end)."""
        with self.lock:
            if not self.closed:
                self.ring.mark_ended()
        try:
            if store:
                self.drain()
        finally:
            self._give_back(store and give_back)

    def _give_back(self, store: bool = True) -> None:
        with self.lock:
            if self.closed:
                return  # closed meanwhile by another thread
            self.closed = True
            left, self.granted = list(self.granted), set()
        with self.hosted._count_lock:
            self.hosted.put_channels -= 1
        try:
            if store:
                self.store.release_granted(left)
        finally:
            os.close(self.doorbell)
            self.segment.close()


class Drainer:
    """One thread that commits every channel's ring when its doorbell rings (and, as a
    safety net, every DRAIN_S even if a doorbell was missed)."""

    DRAIN_S = 0.5

    def __init__(self) -> None:
        self._epoll = select.epoll()
        # rung by close: the thread waits in epoll for up to DRAIN_S, which every daemon
        # stop paid in full (~0.4 s of a ~0.5 s stop)
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll.register(self._wake, select.EPOLLIN)
        self._channels: dict[int, PutChannel] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-puts", daemon=True)
        self._thread.start()

    def add(self, ch: PutChannel) -> None:
        with self._lock:
            self._channels[ch.doorbell] = ch
            self._epoll.register(ch.doorbell, select.EPOLLIN)

    def remove(self, ch: PutChannel) -> None:
        with self._lock:
            if self._channels.pop(ch.doorbell, None) is not None:
                try:
                    self._epoll.unregister(ch.doorbell)
                except (ValueError, OSError):
                    pass  # the drainer has stopped (shutdown)

    def _run(self) -> None:
        # the doorbell wakes this thread once per put: as a normal thread, on a busy host it
        # displaced the putting client mid-copy (16-44% of 256 KiB puts took over 100 us
        # under --busy 2; 1.4-2.9% as a background thread, puts/s up 50-80%)
        background_thread("kvtier-puts")
        later: dict[int, PutChannel] = {}  # rings left awake, their clients still putting
        swept = time.monotonic()
        while not self._stop.is_set():
            try:
                events = self._epoll.poll(REVISIT_S if later else self.DRAIN_S)
                if self._stop.is_set():
                    break
                now = time.monotonic()
                with self._lock:  # (a channel removed meanwhile is skipped)
                    ready = {fd: self._channels.get(fd) for fd in later}
                    ready.update((fd, self._channels.get(fd)) for fd, _ in events)
                    if now - swept >= self.DRAIN_S:  # the periodic pass: every channel (a
                        swept = now  # doorbell missed)
                        ready.update(self._channels)
                later.clear()
                for fd, ch in ready.items():
                    if ch is not None and not self._ring(ch):
                        later[fd] = ch
            except Exception:  # noqa: BLE001 - logged; the thread must outlive any one error
                log.exception("draining put channels failed; carrying on")

    @staticmethod
    def _ring(ch: PutChannel) -> bool:
        """Drain `ch` (`drain_pass`): False when its client was still putting (come back
        to it after REVISIT_S)."""
        with ch.lock:  # (closed sets under it before the doorbell's number is let go: a
            if ch.closed:  # read after that could take 8 bytes from whatever reused it)
                return True
            try:
                os.eventfd_read(ch.doorbell)
            except (BlockingIOError, OSError):
                pass  # nothing rang (a revisit, the periodic pass)
        if not ch.hosted.enter():
            return True  # its namespace is being cleared: nothing of it may be touched
        try:
            return ch.drain_pass()
        finally:
            ch.hosted.leave()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        os.eventfd_write(self._wake, 1)
        self._thread.join(5)
        self._epoll.close()
        os.close(self._wake)
