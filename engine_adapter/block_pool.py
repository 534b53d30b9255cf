"""The paged cache's blocks: ref counts, a free queue, and the prefix cache (hash -> block).

A block with ref_cnt 0 sits in the free queue but keeps its hash and contents until it is
reallocated, so a later request with the same prefix can still hit it (lazy eviction).
The free queue is a doubly linked list threaded through the blocks: taking a block out of
the middle (a prefix hit on a free block) is O(1) and the hot path allocates nothing.
Freed blocks go to the tail, a request's blocks tail-first, so the end of a prefix chain
is reallocated before its parents.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from kvstore.keys import BlockHash


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with a sentinel; O(1) popleft / append[left] / remove."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._head.prev_free = self._head.next_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVCacheBlock) -> None:
        last = self._head.prev_free
        block.prev_free, block.next_free = last, self._head
        last.next_free = self._head.prev_free = block
        self.num_free += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self._head.next_free
        block.prev_free, block.next_free = self._head, first
        first.prev_free = self._head.next_free = block
        self.num_free += 1

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block is not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVCacheBlock:
        assert self.num_free > 0, "free queue is empty"
        block = self._head.next_free
        self.remove(block)
        return block

    def __iter__(self):
        b = self._head.next_free
        while b is not self._head:
            yield b
            b = b.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.enable_caching = enable_caching

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def get_cached_prefix(self, hashes: Sequence[BlockHash]) -> list[KVCacheBlock]:
        """The blocks of the longest prefix of `hashes` held in this cache (not touched)."""
        out: list[KVCacheBlock] = []
        if self.enable_caching:
            for h in hashes:
                block = self.cached.get(h)
                if block is None:
                    break
                out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to (cached) blocks, pulling free ones out of the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def allocate_n(self, n: int) -> list[KVCacheBlock] | None:
        """n fresh blocks (ref_cnt 1), evicting their old hashes; None if not enough are free."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if b.block_hash is not None and self.cached.get(b.block_hash) is b:
                del self.cached[b.block_hash]
            b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def free_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free queue tail-first."""
        for b in reversed(blocks):
            assert b.ref_cnt > 0, f"double free of {b}"
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    def free_unused(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Give back blocks just allocated and never filled (no hash): to the head of the
        free queue, the first reallocated, so that they push no cached block out of the
        prefix cache before their turn."""
        for b in blocks:
            assert b.ref_cnt == 1 and b.block_hash is None, f"{b} is in use"
            b.ref_cnt = 0
            self.free_queue.appendleft(b)

    def cache_n(self, blocks: Sequence[KVCacheBlock], hashes: Sequence[BlockHash]) -> None:
        """Register full blocks under their hashes (a hash already cached keeps its block)."""
        if not self.enable_caching:
            return
        for b, h in zip(blocks, hashes):
            if b.block_hash is None:
                b.block_hash = h
                self.cached.setdefault(h, b)
