"""Streaming text adds up to the whole decoded output, multi-byte characters included."""

from __future__ import annotations

from transformers import AutoTokenizer

from engine.detokenizer import IncrementalDetokenizer

TEXT = "Héllo, wörld — 日本語 ok. Ünïcödé ✓ and emoji 🚀🚀 end"


def test_stream_concatenates_to_full_decode(smollm2_dir) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok.encode(TEXT)
    for use_stream in (True, False):
        d = IncrementalDetokenizer(tok)
        if not use_stream:
            d._stream = None  # the window path, as for slow tokenizers
        pieces = [d.push(i) for i in ids]
        assert "".join(pieces) == tok.decode(ids) == d.text()
        assert all("\ufffd" not in p for p in pieces)


def test_ids_beyond_the_tokenizer_vocabulary_add_no_text(smollm2_dir) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    d = IncrementalDetokenizer(tok)
    ids = tok.encode("ok then")
    pieces = [d.push(ids[0]), d.push(len(tok) + 5), d.push(ids[1])]
    assert "".join(pieces) == tok.decode(ids[:2]) == d.text()


class _Wrapper:
    """A tokenizer wrapper with no len(), delegating everything else (as benchmarks use)."""

    def __init__(self, base) -> None:
        self.base = base

    def decode(self, ids, **kw) -> str:
        return self.base.decode(ids, **kw)

    def __getattr__(self, name: str):
        return getattr(self.base, name)


def test_a_wrapper_without_len_uses_its_own_decode(smollm2_dir) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    d = IncrementalDetokenizer(_Wrapper(tok))
    ids = tok.encode(TEXT)
    assert "".join(d.push(i) for i in ids) == tok.decode(ids) == d.text()


def test_the_direct_tokenizer_load_is_autotokenizers(smollm2_dir, tmp_path) -> None:
    """engine.tokenizer skips AutoTokenizer for a generic fast tokenizer: the same class, ids,
    special tokens and chat template; any other class still goes through AutoTokenizer."""
    import json
    import shutil

    from engine.tokenizer import load_tokenizer_at

    auto, direct = AutoTokenizer.from_pretrained(smollm2_dir), load_tokenizer_at(smollm2_dir)
    assert type(direct) is type(auto)
    assert direct.encode(TEXT) == auto.encode(TEXT)
    assert direct.all_special_ids == auto.all_special_ids and direct.eos_token == auto.eos_token
    chat = [{"role": "user", "content": TEXT}]
    assert direct.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(
        chat, tokenize=False
    )
    other = tmp_path / "gpt2-class"
    shutil.copytree(smollm2_dir, other, ignore=shutil.ignore_patterns("*.safetensors", "*.gguf"))
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(
        json.dumps(cfg | {"tokenizer_class": "GPT2Tokenizer"})
    )
    assert load_tokenizer_at(other).encode(TEXT) == auto.encode(TEXT)
