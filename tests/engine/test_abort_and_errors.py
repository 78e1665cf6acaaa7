"""Aborts release everything; bad input gets a clear exception and the engine keeps serving."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from instrumentation.errors import InvalidRequest, ModelNotFound, NotFound, TooLarge
from tests.helpers import Events, hf_greedy


@pytest.mark.parametrize("cache_type", ["radix", "naive"])
def test_abort_mid_chunk_and_mid_decode_releases_everything(
    tiny_llama_dir, cache_type: str
) -> None:
    llm = LLM(str(tiny_llama_dir), cache_type=cache_type, max_extend_tokens=8, progress=False)
    start = llm.kv_stats()
    rng = random.Random(11)
    ev = Events()
    llm.add_event_hook(ev)
    decoding = llm.submit(
        [rng.randrange(3, 49152) for _ in range(5)], SamplingParams(max_tokens=50, ignore_eos=True)
    )
    for _ in range(3):
        llm.step()
    chunked = llm.submit([rng.randrange(3, 49152) for _ in range(40)], SamplingParams(max_tokens=5))
    llm.step()
    rec = llm.step()
    assert rec is not None and rec.items[-1].uid == chunked and rec.items[-1].kind == "chunk"
    assert llm.kv_stats().used > 0
    llm.abort(chunked)
    rec = llm.step()  # the abort applies first: no later step lists the request
    assert rec is not None and chunked not in {it.uid for it in rec.items}
    assert decoding in {it.uid for it in rec.items}
    llm.check_integrity()
    llm.abort(decoding)
    assert llm.step() is None
    assert [e.uid for e in ev.requests("aborted")] == [chunked, decoding]
    end = llm.kv_stats()
    llm.check_integrity()
    assert end.used == start.used == 0 and end.reserved == 0
    if cache_type == "naive":
        assert end.free == start.free == end.total
    else:  # computed prompt pages stay in the prefix cache, evictable
        assert end.cached + end.free == end.total and end.cached > 0
    with pytest.raises(NotFound):
        llm.abort(decoding)  # already ended
    with pytest.raises(NotFound):
        llm.abort(12345)


def test_abort_while_waiting_needs_no_release(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), progress=False)
    uid = llm.submit("hello there", SamplingParams(max_tokens=4))
    llm.abort(uid)
    with pytest.raises(NotFound):
        llm.abort(uid)  # an abort already pending
    assert llm.step() is None
    assert llm.kv_stats().used == 0
    llm.check_integrity()


def test_bad_input_is_rejected_and_engine_keeps_serving(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), max_seq_len=64, progress=False)
    with pytest.raises(InvalidRequest, match="empty"):
        llm.generate([""])
    with pytest.raises(InvalidRequest, match="empty"):
        llm.submit([])
    with pytest.raises(TooLarge, match="max_seq_len=64"):
        llm.generate(["word " * 100])
    with pytest.raises(TooLarge, match="max_seq_len"):
        llm.submit(list(range(10, 60)), SamplingParams(max_tokens=20))
    with pytest.raises(InvalidRequest, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequest, match="max_tokens"):
        SamplingParams(max_tokens=-3)
    with pytest.raises(InvalidRequest, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidRequest, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(InvalidRequest, match="token ids"):
        llm.submit([5, 49152])
    with pytest.raises(InvalidRequest, match="max_extend_tokens"):
        llm.set_config(max_extend_tokens=0)
    with pytest.raises(InvalidRequest, match="unknown policy"):
        llm.set_config(policy="shortest_first")
    assert llm.config_dict() == {
        "max_extend_tokens": 256,
        "policy": "prefill_first",
        "admission": "reserve",
    }
    # a bad prompt among good ones queues none of them
    with pytest.raises(InvalidRequest):
        llm.generate(["fine", ""])
    assert not llm.has_work()
    out = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert out[0]["token_ids"] == hf_greedy(tiny_llama_dir, [[7, 8, 9]], 3)[0]
    llm.check_integrity()


def test_bad_engine_arguments(tiny_llama_dir, tmp_path) -> None:
    with pytest.raises(InvalidRequest, match="max_extend_tokens"):
        LLM(str(tiny_llama_dir), max_extend_tokens=0)
    with pytest.raises(InvalidRequest, match="unknown policy"):
        LLM(str(tiny_llama_dir), policy="fastest")
    with pytest.raises(InvalidRequest, match="page_size"):
        LLM(str(tiny_llama_dir), page_size=0)
    with pytest.raises(InvalidRequest, match="residual_dtype"):
        LLM(str(tiny_llama_dir), residual_dtype="float64")
    with pytest.raises(InvalidRequest, match="overlap must be a bool"):
        LLM(str(tiny_llama_dir), overlap="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="cuda_graph must be a bool"):
        LLM(str(tiny_llama_dir), cuda_graph=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="unknown attention backend 'fast'"):
        LLM(str(tiny_llama_dir), attention_backend="fast")
    with pytest.raises(ModelNotFound, match=str(tmp_path / "nowhere")):
        LLM(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises((ModelNotFound, KeyError, ValueError)):
        LLM(str(tmp_path))


def test_sampling_with_seed_is_reproducible(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), progress=False)
    p = SamplingParams(max_tokens=8, temperature=1.0, top_k=50, top_p=0.9, seed=3, ignore_eos=True)
    a = llm.generate([[11, 12, 13]], p)[0]["token_ids"]
    b = llm.generate([[11, 12, 13]], p)[0]["token_ids"]
    assert a == b and len(a) == 8


def test_eos_stops_unless_ignored(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), progress=False)
    ref = hf_greedy(tiny_llama_dir, [[21, 22, 23]], 30)[0]
    eos = ref[4]  # make the fifth greedy token count as end of sequence
    llm.eos_token_ids = frozenset({eos})
    out = llm.generate([[21, 22, 23]], SamplingParams(max_tokens=30))[0]
    assert out["finish_reason"] == "eos" and out["token_ids"] == ref[: ref.index(eos) + 1]
    out = llm.generate([[21, 22, 23]], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    assert out["finish_reason"] == "length" and out["token_ids"] == ref


def test_extreme_temperatures_sample_without_nan() -> None:
    import torch

    from engine.sampling import sample_tokens

    def sample(*args: object) -> list[int]:
        return sample_tokens(*args).tolist()  # type: ignore[arg-type]

    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0 - 1e-3]])
    for t in (1e-300, 5e-324, 1e-6):
        assert sample(logits, [SamplingParams(temperature=t)], [None]) == [1]
    g = torch.Generator().manual_seed(0)
    hot = [sample(logits, [SamplingParams(temperature=1e308)], [g])[0] for _ in range(200)]
    assert set(hot) == {0, 1, 2, 3}  # an enormous temperature is uniform
