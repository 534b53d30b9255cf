"""Triton implementations of the kernel ops, same signatures as `kernels.ref`.

Runs on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1 was set before this
package was imported (Triton picks its interpreter when the kernels are defined).
"""
from kernels.triton.codec import decode_blocks, encode_blocks
from kernels.triton.copy import gather_blocks, scatter_blocks, write_kv_to_cache
from kernels.triton.decode import paged_decode_attention
from kernels.triton.prefill import paged_prefill_attention

NAME = "triton"

__all__ = ["write_kv_to_cache", "paged_decode_attention", "paged_prefill_attention", "gather_blocks", "scatter_blocks",
           "encode_blocks", "decode_blocks"]
