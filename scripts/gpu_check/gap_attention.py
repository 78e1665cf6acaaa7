"""The attention half of issue 17's SmolLM2 logits gap: FlashInfer's attention alone, one plan
choice at a time, against a float64 reference (the gap section runs it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from engine.kvcache.pool import KVPool
from scripts.gpu_check import common
from scripts.gpu_check.report import Report


@contextlib.contextmanager
def flashinfer_no_split() -> Any:
    """Every FlashInfer plan of engines built inside gets disable_split_kv=True (the partial
    results of a split KV are kept in the output dtype, bf16, before they are merged)."""
    from engine.attention import flashinfer_backend as fb

    orig = fb.FlashInferAttention._plan

    def plan(self: Any, wrapper: Any, idx: Any, *lead: Any, **extra: Any) -> None:
        orig(self, wrapper, idx, *lead, disable_split_kv=True, **extra)

    fb.FlashInferAttention._plan = plan  # type: ignore[method-assign]
    try:
        yield
    finally:
        fb.FlashInferAttention._plan = orig  # type: ignore[method-assign]


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax(QK^T/sqrt(d))V in float64 of the last q.shape[0] positions of k/v
    (bottom-right aligned, as the engine's kernels), GQA heads grouped as FlashInfer does."""
    nq, hq, d = q.shape
    t, hk, _ = k.shape
    g = hq // hk
    qd = q.double().transpose(0, 1)
    kd = k.double().repeat_interleave(g, dim=1).transpose(0, 1)
    vd = v.double().repeat_interleave(g, dim=1).transpose(0, 1)
    s = qd @ kd.transpose(1, 2) * d**-0.5  # [hq, nq, t]
    qpos = torch.arange(t - nq, t, device=q.device).unsqueeze(1)
    s = s.masked_fill(torch.arange(t, device=q.device).unsqueeze(0) > qpos, float("-inf"))
    return (torch.softmax(s, -1) @ vd).transpose(0, 1)


def attn_errs(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(last position, all positions): relative error, the worst head of each."""
    o, w = out.double(), ref.double()
    last = (o[-1] - w[-1]).norm(dim=-1) / w[-1].norm(dim=-1).clamp_min(1e-30)
    every = (o - w).norm(dim=(0, 2)) / w.norm(dim=(0, 2)).clamp_min(1e-30)
    return float(last.max()), float(every.max())


class AttnBench:
    """FlashInfer, Triton and SDPA attention called directly on one layer's q, k, v."""

    def __init__(self) -> None:
        self.ws = torch.zeros(256 << 20, dtype=torch.uint8, device=common.DEV)
        self.wrappers: dict[tuple[Any, ...], Any] = {}  # one per kind, planned again per call

    def wrapper(self, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        if key not in self.wrappers:
            self.wrappers[key] = make()
        return self.wrappers[key]

    @staticmethod
    def paged(k: torch.Tensor, v: torch.Tensor, page: int) -> tuple[torch.Tensor, ...]:
        t, hk, d = k.shape
        npages = (t + page - 1) // page
        kc = torch.zeros(npages * page, hk, d, dtype=k.dtype, device=k.device)
        vc = torch.zeros_like(kc)
        kc[:t], vc[:t] = k, v
        indptr = torch.tensor([0, npages], dtype=torch.int32)
        indices = torch.arange(npages, dtype=torch.int32)
        last = torch.tensor([t - (npages - 1) * page], dtype=torch.int32)
        return kc.view(npages, page, hk, d), vc.view(npages, page, hk, d), indptr, indices, last

    def fi_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        page: int = 16,
        backend: str = "fa2",
        **plan_kw: Any,
    ) -> torch.Tensor:
        import flashinfer

        kc, vc, indptr, indices, last = self.paged(k, v, page)
        w = self.wrapper(
            ("paged", backend),
            lambda: flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.ws, "NHD", backend=backend),
        )
        qo = torch.tensor([0, q.shape[0]], dtype=torch.int32)
        w.plan(
            qo, indptr, indices, last, q.shape[1], k.shape[1], k.shape[2], page,
            causal=True, sm_scale=k.shape[2] ** -0.5, q_data_type=q.dtype,
            kv_data_type=k.dtype, **plan_kw,
        )  # fmt: skip
        self.last_backend = getattr(w, "_backend", backend)
        return w.run(q, (kc, vc))

    def fi_ragged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **plan_kw: Any) -> Any:
        import flashinfer

        w = self.wrapper(
            ("ragged",),
            lambda: flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.ws, "NHD", backend="fa2"),
        )
        qo = torch.tensor([0, q.shape[0]], dtype=torch.int32)
        kv = torch.tensor([0, k.shape[0]], dtype=torch.int32)
        w.plan(
            qo, kv, q.shape[1], k.shape[1], k.shape[2], causal=True,
            sm_scale=k.shape[2] ** -0.5, q_data_type=q.dtype, kv_data_type=k.dtype, **plan_kw,
        )  # fmt: skip
        return w.run(q, k, v)

    def fi_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensor_cores: bool, **plan_kw: Any
    ) -> torch.Tensor:
        import flashinfer

        kc, vc, indptr, indices, last = self.paged(k, v, 16)
        w = self.wrapper(
            ("decode", tensor_cores),
            lambda: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.ws, "NHD", use_tensor_cores=tensor_cores
            ),
        )
        w.plan(
            indptr, indices, last, q.shape[1], k.shape[1], k.shape[2], 16,
            sm_scale=k.shape[2] ** -0.5, q_data_type=q.dtype, kv_data_type=k.dtype, **plan_kw,
        )  # fmt: skip
        return w.run(q, (kc, vc))

    @staticmethod
    def engine(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page: int = 16) -> Any:
        """The engine's own backend class (prepare + forward) on a pool and page table, as a
        step runs it: a prefill when q has every position, a decode when it has the last one
        (the earlier K and V already cached). Pages in shuffled order, as a running engine has."""
        from engine.attention.base import BatchLayout
        from engine.kvcache.table import PageTable

        if name == "flashinfer":
            from engine.attention.flashinfer_backend import FlashInferAttention as cls
        elif name == "triton":
            from engine.attention.triton_backend import TritonAttention as cls
        else:
            from engine.attention.torch_backend import TorchAttention as cls
        nq, hq, d = q.shape
        t, hk, _ = k.shape
        npages = -(-t // page)
        dev = torch.device(common.DEV)
        pool = KVPool(1, npages + 4, page, hk, d, k.dtype, dev)
        table = PageTable(1, npages * page, page)
        row = table.take_row()
        order = torch.randperm(npages + 4, generator=torch.Generator().manual_seed(t))
        table.map_pages(row, 0, order[:npages].tolist())
        start = t - nq
        if start:
            pool.store(0, table.slots[row, :start].to(dev), k[:start], v[:start])
        out_loc = table.slots[row, start:t].to(dev)
        layout = BatchLayout(rows=[row], starts=[start], ends=[t], out_loc=out_loc, table=table)
        backend = cls(pool, hq, hk, d)  # type: ignore[abstract]
        return backend.forward(q, k[start:], v[start:], 0, backend.prepare(layout))

    @staticmethod
    def strided_q(q: torch.Tensor, hk: int) -> torch.Tensor:
        """q as the engine hands it over: a view into a [T, (Hq + 2 Hk) * D] qkv buffer."""
        t, hq, d = q.shape
        buf = torch.zeros(t, (hq + 2 * hk) * d, dtype=q.dtype, device=q.device)
        view = buf[:, : hq * d].view(t, hq, d)
        view.copy_(q)
        return view

    @staticmethod
    def triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page: int = 16) -> Any:
        from engine.kernels.attention import paged_attention, tiles

        nq, hq, d = q.shape
        t, hk, _ = k.shape
        kc, vc, indptr, indices, _ = AttnBench.paged(k, v, page)
        treq, tq0 = tiles([nq], hq // hk)

        def i32(x: Any) -> torch.Tensor:
            return torch.as_tensor(x, dtype=torch.int32).to(common.DEV)

        return paged_attention(
            q.contiguous(), kc.view(-1, hk, d), vc.view(-1, hk, d), i32(treq), i32(tq0),
            i32([0, nq]), i32([t]), i32(indptr), i32(indices), page, d**-0.5,
        )  # fmt: skip

    @staticmethod
    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, which: str | None = None) -> Any:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        nq, hq, d = q.shape
        t, hk, _ = k.shape
        g = hq // hk
        qt = q.transpose(0, 1).unsqueeze(0)
        kt = k.repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0)
        vt = v.repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0)
        mask = None
        if 1 < nq < t:  # bottom-right causal
            qpos = torch.arange(t - nq, t, device=q.device).unsqueeze(1)
            mask = torch.arange(t, device=q.device).unsqueeze(0) <= qpos
        ctx = (
            contextlib.nullcontext() if which is None else sdpa_kernel([getattr(SDPBackend, which)])
        )
        with ctx:
            o = F.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=mask, is_causal=nq == t and nq > 1, scale=d**-0.5
            )
        return o[0].transpose(0, 1)


# fmt: off
PREFILL_VARIANTS: list[tuple[str, Callable[[AttnBench, Any, Any, Any], Any]]] = [
    ("engine's FlashInferAttention (prepare + forward), page 16",
     lambda b, q, k, v: b.engine("flashinfer", q, k, v)),
    ("engine's TritonAttention, page 16", lambda b, q, k, v: b.engine("triton", q, k, v)),
    ("engine's TorchAttention, page 16", lambda b, q, k, v: b.engine("torch", q, k, v)),
    ("FlashInfer paged prefill wrapper alone, fa2, page 16 (the engine's plan)",
     lambda b, q, k, v: b.fi_prefill(q, k, v)),
    ("  the same, q a strided view of a qkv buffer (as in the engine)",
     lambda b, q, k, v: b.fi_prefill(b.strided_q(q, k.shape[1]), k, v)),
    ("  the same, disable_split_kv=True",
     lambda b, q, k, v: b.fi_prefill(q, k, v, disable_split_kv=True)),
    ("  the same, page 1",
     lambda b, q, k, v: b.fi_prefill(q, k, v, page=1)),
    ("  the same, page 1, disable_split_kv=True",
     lambda b, q, k, v: b.fi_prefill(q, k, v, page=1, disable_split_kv=True)),
    ("FlashInfer ragged prefill, fa2",
     lambda b, q, k, v: b.fi_ragged(q, k, v)),
    ("  the same, disable_split_kv=True",
     lambda b, q, k, v: b.fi_ragged(q, k, v, disable_split_kv=True)),
    ("Triton paged kernel (engine.kernels.attention), page 16",
     lambda b, q, k, v: b.triton(q, k, v)),
    ("torch SDPA bf16, default backend", lambda b, q, k, v: b.sdpa(q, k, v)),
    ("torch SDPA bf16, FLASH_ATTENTION", lambda b, q, k, v: b.sdpa(q, k, v, "FLASH_ATTENTION")),
    ("torch SDPA bf16, EFFICIENT_ATTENTION",
     lambda b, q, k, v: b.sdpa(q, k, v, "EFFICIENT_ATTENTION")),
    ("torch SDPA bf16, CUDNN_ATTENTION", lambda b, q, k, v: b.sdpa(q, k, v, "CUDNN_ATTENTION")),
    ("torch SDPA bf16, MATH", lambda b, q, k, v: b.sdpa(q, k, v, "MATH")),
]
CHUNK = 256  # the engine's default max_extend_tokens: a long prompt is prefilled in such chunks
CHUNK_VARIANTS: list[tuple[str, Callable[[AttnBench, Any, Any, Any], Any]]] = [
    ("chunk: engine's FlashInferAttention, last chunk after the cached prefix",
     lambda b, q, k, v: b.engine("flashinfer", q, k, v)),
    ("chunk: engine's TritonAttention", lambda b, q, k, v: b.engine("triton", q, k, v)),
    ("chunk: engine's TorchAttention", lambda b, q, k, v: b.engine("torch", q, k, v)),
    ("chunk: FlashInfer paged prefill wrapper alone, fa2, page 16",
     lambda b, q, k, v: b.fi_prefill(q, k, v)),
    ("chunk:   the same, disable_split_kv=True",
     lambda b, q, k, v: b.fi_prefill(q, k, v, disable_split_kv=True)),
    ("chunk:   the same, page 1", lambda b, q, k, v: b.fi_prefill(q, k, v, page=1)),
    ("chunk: torch SDPA bf16 (bottom-right causal mask)", lambda b, q, k, v: b.sdpa(q, k, v)),
]
DECODE_VARIANTS: list[tuple[str, Callable[[AttnBench, Any, Any, Any], Any]]] = [
    ("decode: engine's FlashInferAttention (prepare + forward), page 16",
     lambda b, q, k, v: b.engine("flashinfer", q, k, v)),
    ("decode: engine's TritonAttention", lambda b, q, k, v: b.engine("triton", q, k, v)),
    ("decode: engine's TorchAttention", lambda b, q, k, v: b.engine("torch", q, k, v)),
    ("decode: FlashInfer decode wrapper alone, tensor cores, page 16 (the engine's)",
     lambda b, q, k, v: b.fi_decode(q, k, v, True)),
    ("decode:   the same, disable_split_kv=True",
     lambda b, q, k, v: b.fi_decode(q, k, v, True, disable_split_kv=True)),
    ("decode: FlashInfer paged prefill, fa2, one query",
     lambda b, q, k, v: b.fi_prefill(q, k, v)),
    ("decode: Triton paged kernel", lambda b, q, k, v: b.triton(q, k, v)),
    ("decode: torch SDPA bf16, default backend", lambda b, q, k, v: b.sdpa(q, k, v)),
]
# JIT-compiled on first use (tens of seconds each): run last, while time is left
SLOW_VARIANTS: list[tuple[str, Callable[[AttnBench, Any, Any, Any], Any]]] = [
    ("FlashInfer paged prefill, backend auto (fa3 on Hopper), page 16",
     lambda b, q, k, v: b.fi_prefill(q, k, v, backend="auto")),
    ("decode: FlashInfer decode wrapper, CUDA cores (use_tensor_cores=False)",
     lambda b, q, k, v: b.fi_decode(q, k, v, False)),
]
# fmt: on
FP16_QK_NOTE = (
    "use_fp16_qk_reduction=True: not run. FlashInfer 0.5.3 accumulates QK in half only when q is "
    "float16 (include/flashinfer/attention/prefill.cuh: DTypeQKAccum = USE_FP16_QK_REDUCTION && "
    "DTypeQ is half ? half : float), so for bf16 it is the same kernel, at the cost of a JIT build."
)


def gap_inputs(t: int = 512, seed: int = 0) -> dict[str, tuple[torch.Tensor, ...]]:
    """Synthetic q, k, v of SmolLM2's attention (9 query heads, 3 KV heads, head dim 64), bf16."""
    gen = torch.Generator(device=common.DEV).manual_seed(seed)
    hq, hk, d = 9, 3, 64

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=common.DEV)

    q, k, v = randn(t, hq, d), randn(t, hk, d), randn(t, hk, d)
    bf = torch.bfloat16
    sets = {"random N(0, 1)": (q, k, v), "peaked: q and k x2 (scores sd 4)": (2 * q, 2 * k, v)}
    u = randn(d)
    u = u / u.norm()
    qs, ks, vs = q + 4 * u, k.clone(), v.clone()
    ks[0] = 16 * u  # every query scores position 0 about +8 over the rest
    vs[0] *= 0.05  # a sink's value is small
    sets["sink at position 0 (score +8, value x0.05)"] = (qs, ks, vs)
    return {name: tuple(x.to(bf).contiguous() for x in qkv) for name, qkv in sets.items()}


def run_attention_variants(
    bench: AttnBench,
    sets: dict[str, list[tuple[torch.Tensor, ...]]],
    refs: dict[str, list[torch.Tensor]],
    variants: list[tuple[str, Callable[[AttnBench, Any, Any, Any], Any]]],
    results: dict[str, dict[str, Any]],
    left: Callable[[], float] | None = None,
) -> None:
    """For every input set (a list of layers' q, k, v: the worst layer counts) and variant:
    (last position, all positions) relative error against the float64 reference (`refs`, one
    per layer; a decode variant takes the last query and compares with the reference's last
    row, the same attention). `left()`: seconds to the deadline; a variant's first use may JIT
    a new FlashInfer module (25 s or more), so those past it are recorded as skipped."""
    for set_name, layers in sets.items():
        for name, fn in variants:
            if left is not None and left() < 45:
                results.setdefault(set_name, {})[name] = {"error": "skipped: out of time"}
                continue
            kind = variant_kind(name)
            worst = [0.0, 0.0, -1]
            try:
                for i, (q, k, v) in enumerate(layers):
                    nq = queries_of(kind, q.shape[0])
                    qq, ref = q[-nq:], refs[set_name][i][-nq:]
                    out = fn(bench, qq, k, v)
                    if out.is_cuda:
                        torch.cuda.synchronize()
                    last, every = attn_errs(out, ref)
                    if last > worst[0]:
                        worst[2] = i
                    worst[0], worst[1] = max(worst[0], last), max(worst[1], every)
                res: Any = {"last": worst[0], "all": worst[1], "layer": worst[2]}
                if "auto" in name:
                    res["backend"] = getattr(bench, "last_backend", "?")
            except Exception as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                res = {"error": f"{type(e).__name__}: {first[:160]}"}
            results.setdefault(set_name, {})[name] = res
            print(set_name, name, res, flush=True)


def variant_kind(name: str) -> str:
    """prefill (every position of the prompt at once), chunk (the last chunk of a prompt
    prefilled CHUNK tokens at a time, after its cached prefix) or decode (the last position)."""
    return next((k for k in ("decode", "chunk") if name.startswith(k)), "prefill")


def queries_of(kind: str, t: int) -> int:
    """How many of a t-token prompt's last positions a variant of this kind computes."""
    if kind == "decode":
        return 1
    if kind == "chunk":
        return t % CHUNK or min(t, CHUNK)
    return t


def _floor_row(refs: dict[str, list[torch.Tensor]]) -> dict[str, Any]:
    """What rounding the exact result to bf16 alone costs: no kernel can do better."""
    out = {}
    for set_name, layers in refs.items():
        last = every = 0.0
        for ref in layers:
            a, b = attn_errs(ref.to(torch.bfloat16), ref)
            last, every = max(last, a), max(every, b)
        out[set_name] = {"last": last, "all": every, "layer": -1}
    return out


def _attention_table(r: Report, title: str, results: dict[str, dict[str, Any]]) -> None:
    rows = []
    for set_name, per in results.items():
        for name, res in per.items():
            if "error" in res:
                rows.append([set_name, name, "failed", res["error"], ""])
            else:
                layer = "" if res["layer"] < 0 else res["layer"]
                rows.append([set_name, name, res["last"], res["all"], layer])
    r.table(
        title,
        [
            "inputs",
            "variant",
            "rel. err, last position (worst head)",
            "rel. err, all positions (worst head)",
            "worst layer",
        ],
        rows,
    )
