"""Owns the paged KV cache and turns a scheduled batch into one model forward pass."""
from __future__ import annotations

import torch

import kernels
from engine_adapter.config import EngineConfig
from engine_adapter.loader import DTYPES
from engine_adapter.model import AttentionMetadata, LlamaForCausalLM
from engine_adapter.scheduler import ScheduledRequest


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, config: EngineConfig) -> None:
        cfg = model.config
        self.model, self.config = model, config
        self.kv_cache = kernels.allocate_kv_cache(
            config.num_blocks, cfg.num_layers, config.block_tokens, cfg.num_kv_heads,
            cfg.head_dim, dtype=DTYPES[config.dtype], device=config.device)

    def prepare(self, batch: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bt, dev = self.config.block_tokens, self.config.device
        ids, positions, slots, seq_lens, cu = [], [], [], [], [0]
        max_blocks = max(len(s.request.blocks) for s in batch)
        tables = torch.zeros(len(batch), max_blocks, dtype=torch.int32)
        for i, (req, n) in enumerate(batch):
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            ids.extend(req.token_ids[start:end])
            positions.extend(range(start, end))
            block_ids = [b.block_id for b in req.blocks]
            slots.extend(block_ids[p // bt] * bt + p % bt for p in range(start, end))
            tables[i, :len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
            seq_lens.append(end)
            cu.append(cu[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=tables.to(dev), seq_lens=torch.tensor(seq_lens, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            max_query_len=max(s.num_new_tokens for s in batch))
        return (torch.tensor(ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), meta)

    def execute(self, batch: list[ScheduledRequest], sample_rows: list[int]) -> torch.Tensor:
        """Run the batch; logits `[len(sample_rows), vocab]` (float32) of the last new token
        of each batch entry listed in `sample_rows`."""
        input_ids, positions, meta = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)  # [T, hidden]
        last = meta.cu_seqlens_q[1:].to(torch.int64) - 1  # [batch] row of each last token
        return self.model.compute_logits(hidden[last[sample_rows]])  # [n, vocab]
