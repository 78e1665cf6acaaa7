"""ModelRunner: turns a scheduled batch into tensors, runs the model and samples.

Only rows that sample get logits: the last position of each finished prompt and each decode.
A chunk's logits would belong to a mid-prompt position and are never computed.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, BatchLayout
from engine.kvcache.pool import KVPool
from engine.kvcache.table import PageTable
from engine.models.llama import CausalLM
from engine.sampling import sample
from engine.scheduler.batch import Batch


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        table: PageTable,
        backend: AttentionBackend,
        device: torch.device,
    ) -> None:
        self.model, self.pool, self.table, self.backend = model, pool, table, backend
        self.device = device

    def layout(self, batch: Batch) -> tuple[BatchLayout, list[int], list[int]]:
        ids: list[int] = []
        positions: list[int] = []
        out_loc: list[torch.Tensor] = []
        for req in batch.reqs:
            ids += req.all_ids[req.cached_len : req.device_len]
            positions += range(req.cached_len, req.device_len)
            out_loc.append(self.table.slots[req.table_idx, req.cached_len : req.device_len])
        layout = BatchLayout(
            rows=[r.table_idx for r in batch.reqs],
            starts=[r.cached_len for r in batch.reqs],
            ends=[r.device_len for r in batch.reqs],
            out_loc=torch.cat(out_loc).to(self.device, non_blocking=True),
            table=self.table,
        )
        return layout, ids, positions

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[int]:
        """Sampled token ids, one per request that samples this step, in batch order."""
        layout, ids, positions = self.layout(batch)
        meta = self.backend.prepare(layout)
        input_ids = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.int64).to(self.device, non_blocking=True)
        hidden = self.model(input_ids, pos, self.backend, meta)
        sampling = [i for i, r in enumerate(batch.reqs) if batch.kind(r) != "chunk"]
        if not sampling:
            return []
        last = [layout.qo_indptr[i + 1] - 1 for i in sampling]
        logits = self.model.logits(hidden[torch.tensor(last, device=self.device)]).float()
        reqs = [batch.reqs[i] for i in sampling]
        return sample(logits, [r.state.params for r in reqs], [r.state.generator for r in reqs])
