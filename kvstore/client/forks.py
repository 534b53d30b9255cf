"""Clients across `os.fork()`: a child inherits its parent's client objects, and with them
the parent's sockets, put ring and transfer agent. Used from both processes, two callers
shared one connection's frames (each read the other's replies: a get handed back another
block's bytes) and one put ring (both took the same grants: blocks stored under the wrong
hash, for every client of the namespace). So in the child, each live client lets go of
what it held, touching nothing the parent still uses (`_after_fork`: no request, no
FLUSH, no lock the parent's threads may have held), and connects afresh on its next call.
"""
from __future__ import annotations

from transfer.forks import track  # noqa: F401 - the clients' registry (transfer's own)
