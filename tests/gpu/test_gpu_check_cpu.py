"""A CPU dry run of the GPU check's (scripts/gpu_check/) `kernels`, `gap` and `smollm2`
sections: kernel classification and the per-step tables, the float64 attention reference, the per-layer q/k/v capture, and the
variant loop with its error guard (FlashInfer and Triton variants fail on CPU and are recorded
as failures, SDPA runs)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.checks import greedy
from scripts.gpu_check import common, gap, gap_attention, report, smollm2
from scripts.gpu_check import kernels as kernel_section

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sections' one device name, swapped for this dry run."""
    monkeypatch.setattr(common, "DEV", "cpu")


NAMES = {
    "void flashinfer::BatchPrefillWithPagedKVCacheKernel<flashinfer::KernelTraits<...>>": (
        "attention"
    ),
    "void flashinfer::PersistentVariableLengthMergeStatesKernel<8u, 16u>": "attention",
    "_paged_attention_kernel": "attention",
    "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT": "gemm",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>": (
        "gemm"
    ),
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, 128, 16, 4, 4, false>": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "gemm",
    "void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>": "norm",
    "_add_rmsnorm_kernel": "norm",
    "void flashinfer::BatchQKApplyRotaryPosIdsCosSinCacheKernel<false, 64u>": "rope",
    "void flashinfer::activation::act_and_mul_kernel<&silu, __nv_bfloat16>": "activation",
    "void at::native::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>": (
        "embedding"
    ),
    "void at::native::index_elementwise_kernel<128, 4, index_copy_kernel_impl<...>>": "kv store",
    "void at::native::reduce_kernel<512, 1, ReduceOp<c10::BFloat16, ArgMaxOps<c10::BFloat16>>>": (
        "sampling"
    ),
    "Memcpy HtoD (Pinned -> Device)": "copy-memset",
    "Memset (Device)": "copy-memset",
    "void at::native::elementwise_kernel<128, 2, direct_copy_kernel_cuda<...>>": "copy-memset",
    "void at::native::vectorized_elementwise_kernel<4, FillFunctor<int>>": "copy-memset",
    "void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<c10::BFloat16>>": "other",
    "some_property_kernel": "other",
}


@pytest.mark.parametrize("name", list(NAMES))
def test_classify_kernel(name: str) -> None:
    assert kernel_section.classify_kernel(name) == NAMES[name]


def test_kernel_breakdown_per_step() -> None:
    gemm, attn, add = "nvjet_a", "BatchDecodeWithPagedKVCacheKernel", "CUDAFunctor_add"
    kernels = [(gemm, 10.0), (gemm, 30.0), (attn, 20.0), (add, 5.0)] * 4  # 4 steps
    b = kernel_section.kernel_breakdown(kernels, 4, top=2)
    assert b["kernels_per_step"] == 4 and b["us_per_step"] == pytest.approx(65.0)
    c = b["classes"]
    assert c["gemm"]["kernels"] == pytest.approx(2) and c["gemm"]["us"] == pytest.approx(40)
    assert c["attention"]["share"] == pytest.approx(20 / 65)
    assert sum(x["share"] for x in c.values()) == pytest.approx(1.0)
    assert [t["name"] for t in b["top"]] == [gemm, attn]
    assert b["top"][0]["calls"] == pytest.approx(2) and b["top"][0]["us"] == pytest.approx(40)
    assert [u["name"] for u in b["unclassified"]] == [add]
    assert kernel_section.kernel_breakdown([], 0)["us_per_step"] == 0.0


def test_device_kernels_keeps_device_events() -> None:
    from torch.autograd import DeviceType

    def ev(name: str, dev: Any, us: float) -> Any:
        return SimpleNamespace(
            name=name,
            trace_name=name,
            device_type=dev,
            time_range=SimpleNamespace(elapsed_us=lambda: us),
        )

    prof = SimpleNamespace(
        events=lambda: [ev("k1", DeviceType.CUDA, 3.0), ev("cudaLaunchKernel", DeviceType.CPU, 9)]
    )
    assert kernel_section.device_kernels(prof) == [("k1", 3.0)]


def test_kernel_tables_render(tmp_path: Path) -> None:
    r = report.Report(tmp_path, 100.0)
    kernels = [("nvjet_a", 40.0), ("BatchPrefillWithPagedKVCacheKernel", 20.0), ("x", 1.0)]
    b = kernel_section.kernel_breakdown(kernels, 1)
    b.update(step_ms=0.1, ctx=540, gemm_bytes=int(1.2e9), kv_bytes=int(2e8))
    kernel_section._kernel_tables(r, "eager", 1, b, 4.0e12)
    text = "\n".join(r.md)
    assert "| gemm | 1 | 40 | 65.6% | 1,200.0 MB | 30,000 | 750% |" in text
    assert "Unclassified: `x`" in text
    r.save()
    json.loads((tmp_path / "gpu_check.json").read_text())


def test_attention_ref_matches_sdpa() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(12, 6, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8)
    ref = gap_attention.attention_ref(q, k, v)
    kk, vv = (x.repeat_interleave(3, dim=1).transpose(0, 1) for x in (k, v))
    want = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True)
    assert torch.allclose(ref.float(), want.transpose(0, 1), atol=1e-5)
    # the last query alone over every key is the causal result's last row
    assert torch.allclose(gap_attention.attention_ref(q[-1:], k, v), ref[-1:], atol=1e-12)
    # a chunk of 4 queries at the end is bottom-right aligned
    assert torch.allclose(gap_attention.attention_ref(q[-4:], k, v), ref[-4:], atol=1e-12)
    last, every = gap_attention.attn_errs(ref * 1.01, ref)
    assert last == pytest.approx(0.01) and every == pytest.approx(0.01)


def test_gap_inputs_and_variant_loop(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(
        gap_attention, "CHUNK", 48
    )  # the last chunk: 16 queries after 48 cached positions
    sets = {n: [x] for n, x in gap_attention.gap_inputs(t=64).items()}
    assert len(sets) == 3
    for (q, k, v), *_ in sets.values():
        assert q.shape == (64, 9, 64) and k.shape == v.shape == (64, 3, 64)
        assert q.dtype == torch.bfloat16
    refs = {
        n: [gap_attention.attention_ref(q, k, v) for q, k, v in layers]
        for n, layers in sets.items()
    }
    results: dict[str, dict[str, Any]] = {}
    for n, res in gap_attention._floor_row(refs).items():
        results.setdefault(n, {})["floor"] = res
    cpu_ok = ("SDPA bf16, default", "SDPA bf16 (bottom-right", "TorchAttention")
    variants = gap_attention.PREFILL_VARIANTS[:1] + [
        v
        for v in gap_attention.PREFILL_VARIANTS
        + gap_attention.CHUNK_VARIANTS
        + gap_attention.DECODE_VARIANTS
        if any(s in v[0] for s in cpu_ok)
    ]
    assert len(variants) == 7, [v[0] for v in variants]
    assert [gap_attention.queries_of(k, 64) for k in ("prefill", "chunk", "decode")] == [64, 16, 1]
    gap_attention.run_attention_variants(
        gap_attention.AttnBench.__new__(gap_attention.AttnBench), sets, refs, variants, results
    )
    for per in results.values():
        assert (
            "error" in per[gap_attention.PREFILL_VARIANTS[0][0]]
        )  # FlashInfer is not here: recorded
        for name, res in per.items():
            if "SDPA" in name or "TorchAttention" in name:
                assert res["last"] < 2e-2 and res["all"] < 2e-2, (name, res)
        assert per["floor"]["last"] < 5e-3
    r = report.Report(tmp_path, 100.0)
    gap_attention._attention_table(r, "t", results)
    rows = [["m", "prefill", 0.03, 0.01, 0.03, 0.008, 0.009, 0.02, 0.02]]
    assert "split-KV off 0.01" in gap.gap_verdict(results, {}, rows)
    # an engine plan that ran: the verdict compares every variant with it
    for per in results.values():
        per[gap_attention.PREFILL_VARIANTS[0][0]] = {"last": 0.04, "all": 0.04, "layer": 0}
    assert "**moves it**" in gap.gap_verdict(results, {}, [])


def test_smol_config_is_smollm2_135m(tmp_path: Path) -> None:
    from engine.models.config import ModelConfig

    r = report.Report(tmp_path, 100.0)
    m = ModelConfig.from_hf(json.loads((gap.smol_dir(r) / "config.json").read_text()))
    assert (m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == (576, 9, 3, 64)
    assert (m.intermediate_size, m.num_layers, m.vocab_size) == (1536, 30, 49152)
    assert m.rope_theta == 100000.0 and m.tie_word_embeddings


def test_capture_qkv_and_sharpen() -> None:
    from engine import LLM

    llm = LLM(
        model=str(REPO / "assets" / "tiny-llama"),
        load_format="dummy",
        device="cpu",
        progress=False,
        max_running_req=2,
        num_pages=256,
        max_seq_len=256,
        cache_type="naive",  # the second capture must prefill again
    )
    m = llm.model_config
    prompt = [random.Random(0).randrange(3, 1000) for _ in range(20)]
    layers = gap.capture_qkv(llm, prompt)
    assert len(layers) == m.num_layers
    q, k, v = layers[0]
    assert q.shape == (20, m.num_heads, m.head_dim) and k.shape == (20, m.num_kv_heads, m.head_dim)
    assert "forward" not in vars(llm.runner.backend)  # the tap is gone
    w = dict(llm.model.named_parameters())["model.layers.0.self_attn.qkv_proj.weight"]
    before = w.detach().clone()
    gap.sharpen(llm, 4.0)
    qk = (m.num_heads + m.num_kv_heads) * m.head_dim
    assert torch.equal(w[:qk], before[:qk] * 4) and torch.equal(w[qk:], before[qk:])
    # the sharpened model's q and k are 4x those of the same prompt before
    q2, k2, _ = gap.capture_qkv(llm, prompt)[0]
    assert torch.allclose(k2, 4 * k, rtol=1e-4, atol=1e-5)


def test_gap_logits_rows_on_cpu(tmp_path: Path, monkeypatch: Any) -> None:
    """The model half of `gap` on a 2-layer model of SmolLM2's head shape: every engine variant
    either gives its errors or records why it could not run (no FlashInfer here)."""
    # no device memory to return on CPU: each `free()` was a full garbage collection of the
    # test process's heap, about 1 s each of the 7
    monkeypatch.setattr(gap, "free", lambda: None)
    # without the interpreter, whatever test module ran before in this process: the Triton row
    # records why it cannot run (the interpreter ran the whole model in Python when it was on)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(gap.SMOL_CONFIG, "num_hidden_layers", 2)
    monkeypatch.setitem(gap.SMOL_CONFIG, "hidden_size", 64 * 9)
    monkeypatch.setitem(gap.SMOL_CONFIG, "intermediate_size", 128)
    monkeypatch.setitem(gap.SMOL_CONFIG, "vocab_size", 2048)
    r = report.Report(tmp_path, 1000.0)
    models = gap.gap_models(r)
    assert [m[0] for m in models[:2]] == [
        "SmolLM2-135M shape, random N(0, 0.02)",
        "the same, q and k x4 (peaked attention)",
    ]
    name, make, cfg_dir = models[1]
    prompts = [[random.Random(i).randrange(3, 2048) for _ in range(12)] for i in range(2)]
    rows, raw = gap.gap_logits(r, name, make, cfg_dir, prompts)
    assert [row[1] for row in rows] == ["prefill", "decode"]
    # on CPU "auto" is the torch backend in float32: the same numbers as HF fp32
    assert raw["flashinfer"]["fp32 prefill"] < 1e-4 and raw["torch"]["fp32 decode"] < 1e-4
    assert "error" in raw["nosplit"]  # FlashInfer is never installed on CPU
    assert "error" in raw["triton"]  # neither CUDA nor the interpreter: the row says why
    assert rows[0][3] == raw["nosplit"]["error"]
    assert rows[0][4] < 1e-4  # page 1
    assert "HF bf16" in gap.gap_verdict({}, {}, rows)


def test_greedy_tables_on_the_cpu(tiny_llama_dir: Path) -> None:
    """The SmolLM2 greedy comparison's logic, on a tiny model in float32: the engine's run equals
    HF's; a run made to part where HF has a clear winner is a mismatch, and the same parting
    is a near-tie once the run's logits there are as far from HF's as the two tokens' gap."""
    from transformers import AutoModelForCausalLM

    from engine import LLM
    from instrumentation.sampling import SamplingParams

    llm = LLM(model=str(tiny_llama_dir), device="cpu", max_running_req=4, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (7, 30, 55)]
    run = greedy.trace_run(llm, prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    summary, detail, raw = smollm2.greedy_tables(prompts, {"engine": run}, hf, hf)
    assert summary[0][:6] == ["engine", 3, 3, 3, 0, 0]  # as HF bf16 (here HF itself), HF fp32
    assert [row[2] for row in detail] == ["=", "=", "="]

    want = raw["hf_fp32"][1]
    ref = common.hf_logits(hf, prompts[1] + want[:2], 1)[0]
    other = int(ref.topk(2).indices[1])  # HF's second choice at step 2
    got = [*want[:2], other, *want[3:]]
    gap = float(ref[want[2]] - ref[other])
    assert gap > 0
    clear = smollm2.greedy_verdict(hf, prompts[1], want, got, lambda j: ref)
    assert clear["diverge"] == 2 and clear["verdict"] == "mismatch" and clear["noise"] == 0
    assert clear["gap"] == pytest.approx(gap)
    noisy = ref + torch.randn(ref.shape, generator=torch.Generator().manual_seed(0)) * gap
    tie = smollm2.greedy_verdict(hf, prompts[1], want, got, lambda j: noisy)
    assert tie["verdict"] == "tie" and tie["noise"] == pytest.approx(gap, rel=0.05)


def test_every_section_has_its_module_and_function() -> None:
    """`python3 -m scripts.gpu_check --sections ...`: each section name finds `sec_<name>` in its
    module (all of them import on a machine without CUDA)."""
    from scripts.gpu_check import main

    for name in main.SECTIONS:
        assert callable(main.section_fn(name)), name
