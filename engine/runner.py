"""ModelRunner: turns a scheduled batch into tensors, runs the model and samples.

Only rows that sample get logits: the last position of each finished prompt and each decode.
A chunk's logits would belong to a mid-prompt position and are never computed. On CUDA a pure
decode step replays a captured graph (engine.cuda_graph) when one fits; every other step runs
eagerly.
"""

from __future__ import annotations

import logging

import torch

from engine.attention.base import AttentionBackend, BatchLayout
from engine.kvcache.pool import KVPool
from engine.kvcache.table import PageTable
from engine.models.llama import CausalLM
from engine.request import Req, RequestState
from engine.sampling import sample
from engine.scheduler.batch import Batch

log = logging.getLogger(__name__)


def token_ids(state: RequestState, start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + output, without concatenating the two lists."""
    prompt, n = state.prompt_ids, state.prompt_len
    if end <= n:
        return prompt[start:end]
    out = state.output_ids
    if start >= n:
        return out[start - n : end - n]
    return prompt[start:] + out[: end - n]


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        table: PageTable,
        backend: AttentionBackend,
        device: torch.device,
        cuda_graph: bool = False,
        pad_page: int | None = None,
        max_graph_batch: int = 256,
    ) -> None:
        """`cuda_graph` asks for decode graphs; they need CUDA, a backend that can be captured
        and `pad_page`, a pool page outside the allocator's range for the padding rows."""
        self.model, self.pool, self.table, self.backend = model, pool, table, backend
        self.device = device
        self.graphs = None
        if cuda_graph and device.type == "cuda":
            from engine.cuda_graph import DecodeGraphs, GraphBackend

            if not isinstance(backend, GraphBackend):
                log.warning("CUDA graphs off: the %s backend cannot be captured", backend.name)
            elif pad_page is None:
                log.warning("CUDA graphs off: no spare KV page for the padding rows")
            else:
                max_batch = min(max_graph_batch, table.slots.shape[0])
                self.graphs = DecodeGraphs(
                    model, backend, table, pad_page, pool.page_size, max_batch, device
                )

    def layout(self, batch: Batch) -> tuple[BatchLayout, list[int], list[int]]:
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        for req in batch.reqs:
            ids += token_ids(req.state, req.cached_len, req.device_len)
            positions += range(req.cached_len, req.device_len)
            rows += [req.table_idx] * req.extend_len
        # one gather for the whole step rather than a slice per request
        out_loc = self.table.slots[torch.tensor(rows), torch.tensor(positions)]
        layout = BatchLayout(
            rows=[r.table_idx for r in batch.reqs],
            starts=[r.cached_len for r in batch.reqs],
            ends=[r.device_len for r in batch.reqs],
            out_loc=out_loc.to(self.device, non_blocking=True),
            table=self.table,
        )
        return layout, ids, positions

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[int]:
        """Sampled token ids, one per request that samples this step, in batch order."""
        reqs = batch.reqs
        if self.graphs is not None and batch.phase == "decode" and self.graphs.fits(len(reqs)):
            logits = self._replay_decode(batch)
            sampling = reqs
        else:
            logits, sampling = self._run_eager(batch)
            if logits is None:
                return []
        if self.device.type == "cuda":
            # wait here, where the wait releases the GIL, rather than inside the sampler's copy
            # to the host: another thread (the event publisher) runs while the GPU works
            torch.cuda.current_stream(self.device).synchronize()
        params = [r.state.params for r in sampling]
        return sample(logits, params, [r.state.generator for r in sampling])

    def _replay_decode(self, batch: Batch) -> torch.Tensor:
        assert self.graphs is not None
        reqs = batch.reqs
        rows = [r.table_idx for r in reqs]
        starts = [r.cached_len for r in reqs]
        ids = [token_ids(r.state, r.cached_len, r.device_len)[0] for r in reqs]
        slots = self.table.slots[torch.tensor(rows), torch.tensor(starts)].tolist()
        return self.graphs.replay(rows, [r.device_len for r in reqs], ids, slots)

    def _run_eager(self, batch: Batch) -> tuple[torch.Tensor | None, list[Req]]:
        layout, ids, positions = self.layout(batch)
        meta = self.backend.prepare(layout)
        input_ids = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.int64).to(self.device, non_blocking=True)
        hidden = self.model(input_ids, pos, self.backend, meta)
        sampling = [i for i, r in enumerate(batch.reqs) if batch.kind(r) != "chunk"]
        if not sampling:
            return None, []
        qo = layout.qo_indptr
        last = [qo[i + 1] - 1 for i in sampling]
        logits = self.model.logits(hidden[torch.tensor(last, device=self.device)]).float()
        return logits, [batch.reqs[i] for i in sampling]
