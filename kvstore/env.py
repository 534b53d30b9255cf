"""Every KVTIER_* environment variable kvtier reads, in one place (strings at the edge).

    KVTIER_URL     a store for engine plugins: kvtier://HOST:PORT (a daemon) or etcd://... (a pool)
    KVTIER_TOKEN   the token that goes with it (and the default of `kvtier stats --token`)
    KVTIER_PATH    a local store directory for engine plugins (instead of a URL)
    KVTIER_CACHE   where `kvtier cluster` / `kvtier demo` keep the converted model (~/.cache/kvtier)
    KVTIER_PARENT_PID  set by `kvtier cluster` / `kvtier demo` on the workers and the store
                   they start: each is sent SIGTERM when that process ends, however it ends

The kernels (`kernels/dispatch.py`) read KVTIER_KERNELS themselves: that layer sits below
this one and imports nothing from it.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

URL, TOKEN, PATH, CACHE = "KVTIER_URL", "KVTIER_TOKEN", "KVTIER_PATH", "KVTIER_CACHE"
PARENT = "KVTIER_PARENT_PID"
PR_SET_PDEATHSIG = 1


def url() -> str:
    return os.environ.get(URL, "")


def token() -> str:
    return os.environ.get(TOKEN, "")


def path() -> str:
    return os.environ.get(PATH, "")


def cache_root() -> str:
    return os.environ.get(CACHE) or os.path.join(os.path.expanduser("~"), ".cache", "kvtier")


def child_of_this_process() -> dict[str, str]:
    """Environment for a child that must not outlive this process (see `exit_with_parent`).
    Only from the main thread: the kernel's parent-death signal follows the thread that
    started the child, and a helper thread may end long before the process does."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {PARENT: str(os.getpid())}


def exit_with_parent() -> None:
    """In a child started with `child_of_this_process`: have the kernel send this process
    SIGTERM when its parent ends (killed with SIGKILL too: a `kvtier demo` stopped that way
    left its workers and store running). The variable is taken out of the environment,
    so what this process starts in turn does not inherit it."""
    parent = os.environ.pop(PARENT, "")
    if not parent.isdigit() or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if os.getppid() != int(parent):  # it ended before the signal was asked for
        os.kill(os.getpid(), signal.SIGTERM)
