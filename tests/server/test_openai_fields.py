"""The request fields that change results, below the HTTP layer: sampling defaults from
generation_config.json, seeds per choice, and chat_template_kwargs reaching the template."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine.server.openai.api import HttpConfig, generation_defaults
from engine.server.openai.app import Endpoints
from engine.server.openai.schema import ApiError, parse_request


def endpoints(defaults: dict[str, Any], tokenizer: Any = None) -> Endpoints:
    info = SimpleNamespace(max_seq_len=1024, num_pages=4096, page_size=1)
    llm = SimpleNamespace(info=info, tokenizer=tokenizer)
    api = SimpleNamespace(engine=llm, config=HttpConfig(sampling_defaults=defaults),
                          metrics=None, router=None)  # fmt: skip
    return Endpoints(api)  # type: ignore[arg-type]


def test_generation_config_defaults_apply_to_fields_left_out(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "bos_token_id": 1}
    ))  # fmt: skip
    defaults = generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert generation_defaults(tmp_path / "missing") == {}
    ep = endpoints(defaults)
    left_out = ep._params(parse_request({"prompt": "p"}, "completion"), [1, 2], 0)
    assert (left_out.temperature, left_out.top_p, left_out.top_k) == (0.6, 0.95, 20)
    assert left_out.max_tokens == 16  # /v1/completions' default
    given = ep._params(parse_request({"prompt": "p", "temperature": 0, "top_k": 0}, "completion"),
                       [1, 2], 0)  # fmt: skip
    assert (given.temperature, given.top_k, given.top_p) == (0.0, -1, 0.95)
    chat = ep._params(parse_request({"messages": [{"role": "user", "content": "q"}]}, "chat"),
                      [1] * 24, 0)  # fmt: skip
    assert chat.max_tokens == 1000  # chat: what the context leaves
    # --generation-config vllm: no defaults, OpenAI's
    plain = endpoints({})._params(parse_request({"prompt": "p"}, "completion"), [1], 0)
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, -1)


def test_choices_get_seed_seed_plus_one_and_any_64_bit_seed_is_accepted() -> None:
    ep = endpoints({})
    for seed in (-(2**63), 2**64 - 1, 7):
        req = parse_request({"prompt": "p", "n": 3, "seed": seed}, "completion")
        seeds = [ep._params(req, [1], j).seed for j in range(3)]
        assert seeds == [(seed + j) % 2**64 for j in range(3)]
    with pytest.raises(ApiError):
        parse_request({"prompt": "p", "seed": 2**64}, "completion")


def test_chat_template_kwargs_reach_the_template() -> None:
    seen: dict[str, Any] = {}

    class Tok:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages: list, **kw: Any) -> str:
            seen.update(kw)
            return "thinking off" if kw.get("enable_thinking") is False else "thinking on"

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [len(w) for w in text.split()]

    ep = endpoints({}, Tok())
    body = {"messages": [{"role": "user", "content": "q"}],
            "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    [(ids, text)] = ep._encode(parse_request(body, "chat"))
    assert text == "thinking off" and seen["enable_thinking"] is False
    assert seen["add_generation_prompt"] is True and seen["tokenize"] is False
