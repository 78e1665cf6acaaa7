"""ModelRunner: turns a scheduled batch into tensors, launches the model and samples on the device.

Only rows that sample get logits: the last position of each finished prompt and each decode.
A chunk's logits would belong to a mid-prompt position and are never computed. On CUDA a pure
decode step replays a captured graph (engine.cuda_graph) when one fits; a prefill or mixed step
of up to `piecewise_max_tokens` tokens replays the piecewise graphs (engine.piecewise_graph),
with attention run eagerly between the pieces; larger steps, and every step on CPU, run eagerly.

`launch` does not wait for the device. Its `Launched` result hands the sampled tokens over when
asked, so the engine can schedule and launch the next step while this one runs (overlap). The
next step's decode rows then take their input token straight from this step's sampled tokens on
the device (`prev`), without a round trip through the host.

Every step is first turned into a `StepPlan` (engine.plan): plain lists of ints that say what to compute. Rank 0
builds it from the batch; under tensor parallelism (engine.distributed) it broadcasts the plan
and every rank runs the same `execute` on it over its own shard. Only rank 0 samples.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine.attention.base import AttentionBackend, BatchLayout
from engine.kvcache.pool import KVPool
from engine.kvcache.table import PageTable
from engine.kvcache.table_sync import TableSync, apply_updates
from engine.models.llama import CausalLM
from engine.plan import RankClock, Ranks, StepPlan, StepTiming
from engine.request import Req, RequestState
from engine.sampling import sample_tokens, token_logprobs
from engine.scheduler.batch import Batch
from instrumentation.records import RankTiming

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


TokenLogprobs = tuple[float, list[tuple[int, float]]]  # the token's, and the top (id, logprob)


def _host_rows(lp: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> list[TokenLogprobs]:
    chosen, values, ids = (t.tolist() for t in lp)
    return [(c, list(zip(i, v, strict=True))) for c, v, i in zip(chosen, values, ids, strict=True)]


@dataclass(eq=False)
class Launched:
    """A launched step's sampled tokens: one per request that samples (`reqs`, in row order),
    on the device, with a host copy under way on CUDA. Under tensor parallelism `timing` gives
    each rank's share of the step once it has run."""

    reqs: list[Req]
    tokens: torch.Tensor | None = None  # int64 [len(reqs)] on the device
    host: torch.Tensor | None = None  # pinned copy of `tokens`, valid once `ready` fires
    ready: torch.cuda.Event | None = None
    timing: StepTiming | None = None
    # for requests with `logprobs`: every sampling row's (chosen, top values, top ids)
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # for requests with `prompt_logprobs`: (request, first position, count) and the rows
    prompt: list[tuple[Req, int, int]] = field(default_factory=list)
    prompt_logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    _rows: dict[int, int] = field(default_factory=dict)

    def row_of(self, uid: int) -> int:
        if not self._rows:
            self._rows = {r.uid: i for i, r in enumerate(self.reqs)}
        return self._rows[uid]

    def done(self) -> bool:
        """True once the tokens can be read without waiting."""
        return self.ready is None or self.ready.query()

    def result(self) -> list[int]:
        """The tokens on the host; waits for the device if the step is still running."""
        if self.tokens is None:
            return []
        if self.ready is None:
            return self.tokens.tolist()
        self.ready.synchronize()  # releases the GIL while it waits
        assert self.host is not None
        return self.host.tolist()

    def logprob_rows(self) -> list[TokenLogprobs] | None:
        """Each sampling row's logprobs on the host (call after `result`)."""
        return None if self.logprobs is None else _host_rows(self.logprobs)

    def prompt_rows(self) -> list[tuple[Req, list[TokenLogprobs]]]:
        """Each prompt-logprobs request's rows of this step, in position order."""
        if self.prompt_logprobs is None:
            return []
        rows, at, out = _host_rows(self.prompt_logprobs), 0, []
        for req, _start, count in self.prompt:
            out.append((req, rows[at : at + count]))
            at += count
        return out

    def rank_times(self) -> tuple[RankTiming, ...] | None:
        """Each rank's time for this step (tensor parallelism only; call after `result`)."""
        return None if self.timing is None else self.timing.read()


class ModelRunner:
    # Prefill and mixed steps of up to this many tokens replay piecewise CUDA graphs
    # (engine.piecewise_graph) where decode graphs are on; 0 runs them eagerly, as before.
    piecewise_max_tokens = 4096

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
        leader: Ranks | None = None,
    ) -> None:
        """`cuda_graph` asks for decode graphs; they need CUDA, a backend that can be captured
        and `pad_page`, a pool page outside the allocator's range for the padding rows.
        `leader` is rank 0's handle on the other tensor-parallel ranks (None: one device)."""
        self.model, self.pool, self.table, self.backend = model, pool, table, backend
        self.device = device
        self.leader = leader
        self.clock = RankClock(model, device) if model.tp.size > 1 else None
        self.sync = TableSync() if leader is not None else None  # the other ranks' tables
        self._seq = 0
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
        self.pieces = None
        if self.graphs is not None and self.piecewise_max_tokens > 0 and model.tp.size == 1:
            from engine.piecewise_graph import PiecewiseGraphs, runs_between_pieces

            if runs_between_pieces(backend):
                assert pad_page is not None
                pad_slot = pad_page * pool.page_size
                self.pieces = PiecewiseGraphs(
                    model, backend, pad_slot, self.piecewise_max_tokens, device
                )
            else:  # e.g. batch-invariant mode's Triton backend: its prefill stays eager
                log.info("prefill graphs off: the %s backend cannot attend between pieces",
                         backend.name)  # fmt: skip

    # -- rank 0: from a batch to a plan -----------------------------------------------------
    def input_ids(
        self, reqs: list[Req], prev: Launched | None
    ) -> tuple[list[int], list[int], list[int]]:
        """Token ids of tokens [cached_len, device_len) of every request, in batch order, plus
        the positions whose token `prev` (the step still in flight) is sampling, and that
        token's row there. Those positions hold 0 until `patch` fills them on the device."""
        ids: list[int] = []
        dst: list[int] = []
        src: list[int] = []
        for req in reqs:
            st = req.state
            known = st.prompt_len + len(st.output_ids)
            if req.device_len <= known:
                ids += token_ids(st, req.cached_len, req.device_len)
                continue
            # only the last token can be missing: the engine is at most one step ahead
            assert prev is not None and req.device_len == known + 1, "input token unknown"
            ids += token_ids(st, req.cached_len, known)
            dst.append(len(ids))
            src.append(prev.row_of(req.uid))
            ids.append(0)
        return ids, dst, src

    def plan(self, batch: Batch, prev: Launched | None = None) -> StepPlan:
        reqs = batch.reqs
        ids, dst, src = self.input_ids(reqs, prev)
        spans, slots = ([], []) if self.sync is None else self.sync.updates(reqs, self.table)
        prompt_rows, prompt_from, prompt_upto = [], [], []
        for i, r in enumerate(reqs):
            # position p scores prompt token p + 1; those scored already are not again
            first = max(r.cached_len, len(r.state.prompt_logprobs))
            upto = min(r.device_len, r.state.prompt_len - 1)
            if r.state.params.prompt_logprobs is not None and first < upto:
                prompt_rows.append(i)
                prompt_from.append(first)
                prompt_upto.append(upto)
        self._seq += 1
        return StepPlan(
            seq=self._seq,
            rows=[r.table_idx for r in reqs],
            starts=[r.cached_len for r in reqs],
            ends=[r.device_len for r in reqs],
            ids=ids,
            patch_dst=dst,
            patch_src=src,
            sample=[i for i, r in enumerate(reqs) if batch.samples(r)],
            decode=batch.phase == "decode",
            prompt_rows=prompt_rows,
            prompt_from=prompt_from,
            prompt_upto=prompt_upto,
            spans=spans,
            slots=slots,
        )

    @torch.inference_mode()
    def launch(self, batch: Batch, prev: Launched | None = None) -> Launched:
        """Queue the step on the device and return without waiting for it. `prev` is the step
        launched before this one if its tokens have not been read yet."""
        plan = self.plan(batch, prev)
        if self.leader is None:
            logits = self.execute(plan, prev.tokens if prev is not None else None)
            return self._sample(batch, plan, logits)
        with self.leader.guard():
            self.leader.publish(plan)
            assert self.clock is not None
            self.clock.start()
            logits = self.execute(plan, prev.tokens if prev is not None else None)
            out = self._sample(batch, plan, logits)
            if out.tokens is not None:
                self.leader.share_tokens(out.tokens)
            out.timing = StepTiming(plan.seq, self.clock.stop(), self.leader)
        return out

    def _sample(self, batch: Batch, plan: StepPlan, logits: torch.Tensor | None) -> Launched:
        if logits is None:
            return Launched([])
        n = len(plan.sample)
        sampling = [batch.reqs[i] for i in plan.sample]
        out = Launched(sampling)
        if n:
            params = [r.state.params for r in sampling]
            out.tokens = sample_tokens(logits[:n], params, [r.state.generator for r in sampling])
            ks = [p.logprobs for p in params if p.logprobs is not None]
            if ks:
                out.logprobs = token_logprobs(logits[:n], out.tokens, max(ks))
        if plan.prompt_rows:
            self._prompt_logprobs(batch, plan, logits[n:], out)
        if self.device.type != "cuda" or out.tokens is None:
            return out
        out.host = torch.empty(out.tokens.shape, dtype=out.tokens.dtype, pin_memory=True)
        out.host.copy_(out.tokens, non_blocking=True)
        out.ready = torch.cuda.Event()
        out.ready.record()
        return out

    def _prompt_logprobs(
        self, batch: Batch, plan: StepPlan, logits: torch.Tensor, out: Launched
    ) -> None:
        """The logprobs of the prompt tokens that the plan's kept positions predict."""
        targets: list[int] = []
        k = 0
        for i, start, upto in zip(
            plan.prompt_rows, plan.prompt_from, plan.prompt_upto, strict=True
        ):
            req = batch.reqs[i]
            out.prompt.append((req, start, upto - start))
            targets += req.state.prompt_ids[start + 1 : upto + 1]
            k = max(k, req.state.params.prompt_logprobs or 0)
        ids = torch.tensor(targets, dtype=torch.int64).to(self.device, non_blocking=True)
        out.prompt_logprobs = token_logprobs(logits, ids, k)

    # -- every rank: run a plan ------------------------------------------------------------
    def apply_table(self, plan: StepPlan) -> None:
        """Write the plan's page-table entries into this rank's copy of the table (ranks > 0:
        rank 0's scheduler owns the real one)."""
        apply_updates(self.table, plan.spans, plan.slots)

    def patch(
        self, buf: torch.Tensor, dst: list[int], src: list[int], prev: torch.Tensor | None
    ) -> None:
        """buf[dst] = prev[src], on the device (ordered after prev's sampling)."""
        if not dst:
            return
        assert prev is not None
        idx = torch.tensor([dst, src], dtype=torch.int64).to(self.device, non_blocking=True)
        buf[idx[0]] = prev[idx[1]]

    def layout(self, plan: StepPlan) -> tuple[BatchLayout, list[int]]:
        positions: list[int] = []
        rows: list[int] = []
        for row, start, end in zip(plan.rows, plan.starts, plan.ends, strict=True):
            positions += range(start, end)
            rows += [row] * (end - start)
        # one gather for the whole step rather than a slice per request
        out_loc = self.table.slots[torch.tensor(rows), torch.tensor(positions)]
        layout = BatchLayout(
            rows=plan.rows,
            starts=plan.starts,
            ends=plan.ends,
            out_loc=out_loc.to(self.device, non_blocking=True),
            table=self.table,
        )
        return layout, positions

    @torch.inference_mode()
    def execute(self, plan: StepPlan, prev: torch.Tensor | None) -> torch.Tensor | None:
        """Run the plan's forward: float32 logits of its sampling rows, then of its kept prompt
        positions, on rank 0; None on other ranks and when no logits are wanted. `prev`: the sampled tokens of the step launched before,
        if the plan patches some input ids from them."""
        if self.graphs is not None and plan.decode and self.graphs.fits(len(plan.rows)):
            return self._replay_decode(plan, prev)
        if self.pieces is not None and self.pieces.fits(len(plan.ids)):
            return self._replay_pieces(plan, prev)
        return self._run_eager(plan, prev)

    def _replay_decode(self, plan: StepPlan, prev: torch.Tensor | None) -> torch.Tensor | None:
        assert self.graphs is not None
        rows = torch.tensor(plan.rows)
        slots = self.table.slots[rows, torch.tensor(plan.starts)].tolist()
        return self.graphs.replay(
            plan.rows,
            plan.ends,
            plan.ids,
            slots,
            fill=lambda io: self.patch(io, plan.patch_dst, plan.patch_src, prev),
        )

    def _replay_pieces(self, plan: StepPlan, prev: torch.Tensor | None) -> torch.Tensor | None:
        assert self.pieces is not None
        positions: list[int] = []
        rows: list[int] = []
        for row, start, end in zip(plan.rows, plan.starts, plan.ends, strict=True):
            positions += range(start, end)
            rows += [row] * (end - start)
        slots = self.table.slots[torch.tensor(rows), torch.tensor(positions)].tolist()

        def prepare(out_loc: torch.Tensor) -> object:
            layout = BatchLayout(plan.rows, plan.starts, plan.ends, out_loc, self.table)
            return self.backend.prepare(layout)

        hidden = self.pieces.run(
            plan.ids,
            positions,
            slots,
            prepare,
            fill=lambda io: self.patch(io, plan.patch_dst, plan.patch_src, prev),
        )
        return self._logits(plan, hidden)

    def _logits(self, plan: StepPlan, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits of the plan's sampling rows (each one's last token) of `hidden`, then
        of its kept prompt positions (prompt logprobs)."""
        if not plan.sample and not plan.prompt_rows:
            return None
        ends = [0]
        for s, e in zip(plan.starts, plan.ends, strict=True):
            ends.append(ends[-1] + e - s)
        last = [ends[i + 1] - 1 for i in plan.sample]
        for i, first, upto in zip(
            plan.prompt_rows, plan.prompt_from, plan.prompt_upto, strict=True
        ):
            at = ends[i] + first - plan.starts[i]  # the row of position `first` in `hidden`
            last += range(at, at + upto - first)  # after the sampling rows
        rows = torch.tensor(last).to(self.device, non_blocking=True)  # no wait for the device
        logits = self.model.logits(hidden[rows])
        return None if logits is None else logits.float()

    def _run_eager(self, plan: StepPlan, prev: torch.Tensor | None) -> torch.Tensor | None:
        layout, positions = self.layout(plan)
        meta = self.backend.prepare(layout)
        input_ids = torch.tensor(plan.ids, dtype=torch.int64).to(self.device, non_blocking=True)
        self.patch(input_ids, plan.patch_dst, plan.patch_src, prev)
        pos = torch.tensor(positions, dtype=torch.int64).to(self.device, non_blocking=True)
        hidden = self.model(input_ids, pos, self.backend, meta)
        return self._logits(plan, hidden)
