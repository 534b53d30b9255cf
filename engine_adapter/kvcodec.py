"""Block codecs at the store boundary, engine side: encode right before a store put, decode
right after a get, batched, on the engine's device. The store, the daemon and the transfer
layer only see `Namespace.block_bytes` opaque bytes (docs/compression.md).

    codec = BlockCodec("int8", block_shape, torch.float32)
    encoded, keep = codec.encode(blocks)        # blocks [n, L, 2, bt, Hkv, D] contiguous
    store.put_n([h for h, k in zip(hashes, keep) if k], encoded[keep])
    staging = codec.staging(n, device)          # uint8 [n, block_bytes], reused
    found = store.get_n(hashes, staging)
    ok = codec.decode(staging[:m], kv_cache, block_ids[:m])   # into kv_cache[block_ids[i]]

`raw` encodes nothing (the blocks themselves go to the store). int8 / fp8_e4m3 are the
quantizing kernels (`kernels.encode_blocks`, Triton on a GPU). `zstd` is lossless: the
block's bytes grouped by significance (every element's byte 0, then byte 1, ...: float
exponents sit together and compress), one zstd frame per block, in a fixed slot of 15/16
of the raw size (slots are fixed-size in every tier: a bound is what makes a variable-size
codec move fewer bytes). A block whose frame does not fit is not stored (`keep` False): the
engine recomputes it later, as it would after a dropped save.
"""
from __future__ import annotations

import math

import numpy as np
import torch

import kernels
from kernels.codec import SCALE_MIN, SPECS, encoded_views
from kvstore.keys import CODECS, ZSTD_HEADER_BYTES, encoded_block_bytes

ZSTD_LEVEL = 1  # level 3 measured no smaller on fp32 KV and ~2x slower


class BlockCodec:
    """One namespace's codec for blocks of `block_shape` [L, 2, bt, Hkv, D] in `dtype`."""

    def __init__(self, codec: str, block_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if codec not in CODECS:
            raise ValueError(f"codec {codec!r} is not one of {', '.join(CODECS)}")
        self.name, self.block_shape, self.dtype = codec, tuple(block_shape), dtype
        self.raw_bytes = math.prod(self.block_shape) * dtype.itemsize
        self.block_bytes = encoded_block_bytes(codec, self.block_shape, dtype.itemsize)
        self._staging = torch.empty((0, self.block_bytes), dtype=torch.uint8)
        self._zstd = _Zstd(self) if codec == "zstd" else None

    @classmethod
    def for_cache(cls, codec: str, kv_cache: torch.Tensor) -> "BlockCodec":
        """The codec of blocks of a paged cache `[num_blocks, L, 2, bt, Hkv, D]`."""
        return cls(codec, tuple(kv_cache.shape[1:]), kv_cache.dtype)

    @property
    def is_raw(self) -> bool:
        return self.name == "raw"

    def encode(self, blocks: torch.Tensor) -> tuple[torch.Tensor, list[bool]]:
        """(encoded [n, block_bytes] uint8, per block whether it is stored); raw: the blocks."""
        n = blocks.shape[0]
        if self.is_raw:
            return blocks, [True] * n
        if self._zstd is not None:
            return self._zstd.encode(blocks)
        return kernels.encode_blocks(blocks.contiguous(), self.name), [True] * n

    def decode(self, encoded: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> int:
        """Decode block i into kv_cache[block_ids[i]]; returns how many leading blocks
        decoded (a zstd frame that fails ends the prefix there, like a miss)."""
        if self._zstd is not None:
            return self._zstd.decode(encoded, kv_cache, block_ids)
        encoded = encoded.to(kv_cache.device)
        good = self._sound(encoded)
        if good:
            kernels.decode_blocks(encoded[:good], self.name, kv_cache,
                                  block_ids[:good].to(kv_cache.device))
        return good

    def _sound(self, encoded: torch.Tensor) -> int:
        """How many leading quantized blocks hold only what the encoder writes: every scale
        finite and within [SCALE_MIN, the codec's largest], and (fp8) no NaN value. A block
        with a NaN or inf scale, from a writer that is not ours (the DRAM tier keeps no
        checksum), had NaN KV decoded into the cache, and the model ran on it."""
        n = encoded.shape[0]
        if n == 0:
            return 0
        values, scales = encoded_views(encoded, self.block_shape)
        s = scales.reshape(n, -1).float()
        ok = (s >= SCALE_MIN).all(1) & (s <= SPECS[self.name].scale_max).all(1)  # (NaN: False)
        if self.name == "fp8_e4m3":  # e4m3fn's NaN: every exponent and mantissa bit set
            ok &= ~((values.reshape(n, -1).view(torch.uint8) & 0x7F) == 0x7F).any(1)
        bad = (~ok).nonzero()
        return n if bad.numel() == 0 else int(bad[0, 0])

    def staging(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """A reusable uint8 [n, block_bytes] buffer to `get_n` encoded blocks into.
        zstd decodes on the CPU, so its staging always is there."""
        device = torch.device("cpu" if self._zstd is not None else device)
        if self._staging.shape[0] < n or self._staging.device != device:
            self._staging = torch.empty((n, self.block_bytes), dtype=torch.uint8, device=device)
        return self._staging[:n]


class _Zstd:
    """zstd of byte-shuffled blocks, in slots of `block_bytes` (u32 frame length, u32 0,
    frame, zero padding). zstandard's multi_* calls run the batch in C."""

    def __init__(self, codec: BlockCodec) -> None:
        try:  # only a zstd namespace needs it (setup.py pins it; engine venvs may lack it)
            import zstandard
        except ImportError as e:
            raise ImportError("the zstd block codec needs the zstandard package: "
                              "pip install zstandard==0.25.0") from e

        self.codec, self.itemsize = codec, codec.dtype.itemsize
        self.numel = math.prod(codec.block_shape)
        # (a content checksum per frame: 4 bytes, and a bit flipped in a frame is a miss, not
        # other KV; frames written without one still decode)
        self.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
        self.decompressor = zstandard.ZstdDecompressor()
        self.content_size = zstandard.frame_content_size

    def shuffle(self, blocks: torch.Tensor) -> np.ndarray:
        """[n, itemsize * numel] uint8: byte 0 of every element, then byte 1, ... (numpy:
        one thread, no torch pool spinning on a busy host)."""
        n = blocks.shape[0]
        planes = blocks.contiguous().cpu().view(torch.uint8).numpy().reshape(n, self.numel, self.itemsize)
        return np.ascontiguousarray(planes.transpose(0, 2, 1)).reshape(n, -1)

    def encode(self, blocks: torch.Tensor) -> tuple[torch.Tensor, list[bool]]:
        shuffled = self.shuffle(blocks)
        frames = self.compressor.multi_compress_to_buffer([row for row in shuffled])
        out = np.zeros((blocks.shape[0], self.codec.block_bytes), dtype=np.uint8)
        room = self.codec.block_bytes - ZSTD_HEADER_BYTES
        keep = []
        for i in range(len(frames)):  # one frame per block: zstd's own granularity
            frame = np.frombuffer(frames[i], dtype=np.uint8)
            keep.append(len(frame) <= room)
            if keep[-1]:
                out[i, :4] = np.frombuffer(len(frame).to_bytes(4, "little"), dtype=np.uint8)
                out[i, ZSTD_HEADER_BYTES:ZSTD_HEADER_BYTES + len(frame)] = frame
        return torch.from_numpy(out), keep

    def decode(self, encoded: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> int:
        rows = encoded.cpu().numpy()
        lengths = rows[:, :4].copy().view("<u4")[:, 0]
        room = rows.shape[1] - ZSTD_HEADER_BYTES
        size = self.itemsize * self.numel
        frames = []  # the leading frames that say they hold one block: decompressed, no
        for i, k in enumerate(lengths):  # other can allocate more than a block (a 16 KB
            if not 0 < k <= room:  # frame of 512 MiB of zeros had: +2 GiB for 4 blocks)
                break
            frame = rows[i, ZSTD_HEADER_BYTES:ZSTD_HEADER_BYTES + k]
            try:
                if self.content_size(frame) != size:  # (-1: not said)
                    break
            except Exception:  # noqa: BLE001 - not a frame header at all
                break
            frames.append(frame)
        good = len(frames)
        if not good:
            return 0
        try:
            plain = self.decompressor.multi_decompress_to_buffer(frames)
        except Exception:  # noqa: BLE001 - bytes that are not our frame (or fail their
            return 0  # checksum): the batch is missing, never a failed load
        if any(len(plain[i]) != size for i in range(good)):
            return 0
        shuffled = np.empty((good, self.itemsize, self.numel), dtype=np.uint8)
        for i in range(good):
            shuffled[i].reshape(-1)[:] = np.frombuffer(plain[i], dtype=np.uint8)
        blocks = torch.from_numpy(np.ascontiguousarray(shuffled.transpose(0, 2, 1)))
        blocks = blocks.view(good, -1).view(kv_cache.dtype).view(good, *self.codec.block_shape)
        kernels.scatter_blocks(blocks.to(kv_cache.device), kv_cache,
                               block_ids[:good].to(kv_cache.device), check_values=False)
        return good


class CodedStore:
    """A store of a compressed namespace under the plugins' block-tensor contract: `put_n`
    takes model blocks and stores them encoded, `get_n` decodes the hits into the caller's
    blocks (a miss, or a block that does not decode, is None and leaves its block as it
    was). The engine plugins (vLLM, SGLang, transformers) wrap their store in this."""

    def __init__(self, store, codec: BlockCodec) -> None:
        self.store, self.codec = store, codec
        self.match_prefix, self.contains_n = store.match_prefix, store.contains_n

    def put_n(self, hashes, srcs: torch.Tensor) -> list:
        encoded, keep = self.codec.encode(_blocks(srcs, self.codec))
        if all(keep):
            return self.store.put_n(hashes, encoded)
        from kvstore.api import PutStatus  # a block with no room in its slot: not stored
        kept = [h for h, k in zip(hashes, keep) if k]
        statuses = iter(self.store.put_n(kept, encoded[torch.tensor(keep)]) if kept else ())
        return [next(statuses) if k else PutStatus.NO_SPACE for k in keep]

    def get_n(self, hashes, dsts: torch.Tensor) -> list:
        dsts = _blocks(dsts, self.codec)
        staging = self.codec.staging(len(hashes), dsts.device)
        found = list(self.store.get_n(hashes, staging))
        hit = [i for i, tier in enumerate(found) if tier is not None]
        if hit:
            rows = torch.tensor(hit, dtype=torch.int64)
            try:
                decoded = self.codec.decode(staging[rows], dsts, rows)
            except Exception:  # bytes no encoder of ours wrote: misses, never a failed read
                decoded = 0
            for i in hit[decoded:]:
                found[i] = None
        return found

    def close(self) -> None:
        close = getattr(self.store, "close", None)
        if close is not None:
            close()


def _blocks(t, codec: BlockCodec) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or tuple(t.shape[1:]) != codec.block_shape \
            or t.dtype != codec.dtype or not t.is_contiguous():
        raise TypeError(f"a {codec.name} store takes one contiguous tensor of blocks "
                        f"[n, {', '.join(map(str, codec.block_shape))}] {codec.dtype}")
    return t
