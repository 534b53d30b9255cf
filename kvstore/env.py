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

import os

URL, TOKEN, PATH, CACHE = "KVTIER_URL", "KVTIER_TOKEN", "KVTIER_PATH", "KVTIER_CACHE"
PARENT = "KVTIER_PARENT_PID"  # read by kvstore.lifetime


def url() -> str:
    return os.environ.get(URL, "")


def token() -> str:
    return os.environ.get(TOKEN, "")


def path() -> str:
    return os.environ.get(PATH, "")


def cache_root() -> str:
    return os.environ.get(CACHE) or os.path.join(os.path.expanduser("~"), ".cache", "kvtier")

