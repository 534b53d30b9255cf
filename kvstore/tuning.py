"""Tuning for a process that moves many MiB-sized blocks (the daemon, benches): its heap,
its cyclic GC (`freeze_gc_heap`), its background threads (`background_thread`) and its
open-file limit (`raise_open_file_limit`).

glibc serves every allocation of 128 KiB or more with a fresh mmap and unmaps it on free, so
each block-sized bytes object RocksDB hands back is first-touched page by page (~10x slower
than a warm copy here). Raising the mmap and trim thresholds keeps freed block buffers in
the heap for the next one. The cost: the process keeps its peak heap instead of returning
it to the OS. A library must not do this behind its caller's back, so it is opt-in.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import resource

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc_for_large_blocks(max_block_bytes: int = 64 << 20) -> bool:
    """Returns False where the C library is not glibc (nothing changed)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, max_block_bytes)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, 4 * max_block_bytes))


_PR_SET_NAME = 15


def background_thread(name: str) -> None:
    """Make the calling thread background work in the kernel's eyes: SCHED_BATCH, so that
    waking it never preempts the thread that woke it (on a busy host a woken normal thread
    displaces the one running on that CPU, here a client's put mid-copy), and named `name`
    for top -H, ps and py-spy (Linux keeps 15 bytes of it). It still gets its fair share of
    the CPU; only its wake-ups wait for the scheduler's next turn. No-op off Linux."""
    batch = getattr(os, "SCHED_BATCH", None)
    if batch is not None:
        try:
            os.sched_setscheduler(0, batch, os.sched_param(0))
        except OSError:
            pass  # a seccomp profile that forbids it: the thread stays a normal one
    try:  # the process's own symbols (libc's among them): find_library would run ldconfig
        prctl = ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        return  # not Linux: the name is cosmetic
    prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def freeze_gc_heap() -> None:
    """Take what the process has built out of the cyclic GC (`gc.freeze()`), and from then
    on what survives each full collection too (`_freeze_survivors`). A full collection walks
    every tracked object holding the GIL: in a process that imported torch that stopped
    every thread for 15-105 ms, and a store's per-block entries pile up in the oldest
    generation, each full pass walking them all (1,000,000 entries: 215 ms, and CPython
    runs one whenever they have grown by a quarter). Frozen objects are still freed when
    their last reference goes; only a cycle among them would outlive its use. Call it once
    the process is set up (`kvtier serve` does once serving; an engine using the SDK, once
    its model is loaded, as vLLM freezes its own heap)."""
    gc.collect()
    gc.freeze()
    if _freeze_survivors not in gc.callbacks:
        gc.callbacks.append(_freeze_survivors)


def _freeze_survivors(phase: str, info: dict) -> None:
    """After a full collection, freeze what survived it: the next one walks only what was
    made since, so no pass grows with what the process holds. Nothing unreachable is frozen:
    the collection has just run."""
    if phase == "stop" and info["generation"] == 2:
        gc.freeze()


def raise_open_file_limit() -> None:
    """The soft open-file limit up to the hard one, as servers do (the daemon, the front
    end): each connection takes a descriptor or more. The daemon's kernel also refuses to
    pass descriptors (same-host clients' shared memory) once those in replies not read yet
    pass the soft limit (ETOOMANYREFS), which at the usual 1024 six connections that never
    read could reach."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = max(soft, 1 << 20)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass  # (kept as it is: the daemon's accepting pauses when it runs out, see dataplane)
