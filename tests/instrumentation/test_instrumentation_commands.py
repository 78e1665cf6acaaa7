"""Command parsing: every malformed frame maps to the protocol's error code, never clamped."""

from __future__ import annotations

import json

import pytest

from instrumentation.commands import (
    Abort,
    CommandError,
    SetConfig,
    Stats,
    Submit,
    parse_command,
)
from instrumentation.sampling import SamplingParams

VOCAB = 100
POLICIES = ("prefill_first", "mixed")


def parse(obj: object) -> object:
    frame = obj if isinstance(obj, str | bytes) else json.dumps(obj)
    return parse_command(frame, vocab_size=VOCAB, policies=POLICIES)


def error_of(obj: object) -> CommandError:
    with pytest.raises(CommandError) as info:
        parse(obj)
    return info.value


def test_valid_commands_parse_with_defaults() -> None:
    cmd = parse({"type": "submit", "id": "a1", "prompt": "hi"})
    assert cmd == Submit(id="a1", prompt="hi")
    assert isinstance(cmd, Submit) and cmd.params.max_tokens == 64 and cmd.params.temperature == 0.0
    full = parse(
        {"type": "submit", "input_ids": [1, 99], "max_tokens": 3, "temperature": 1,
         "top_k": 5, "top_p": 0.5, "ignore_eos": True, "seed": 7, "extra": "ignored"}
    )  # fmt: skip
    params = SamplingParams(
        max_tokens=3, temperature=1.0, top_k=5, top_p=0.5, ignore_eos=True, seed=7
    )
    assert full == Submit(None, [1, 99], params, False)
    assert parse({"type": "abort", "uid": 3}) == Abort(None, 3)
    assert parse({"type": "set_config", "id": "c", "policy": "mixed"}) == SetConfig(
        "c", None, "mixed"
    )
    assert parse({"type": "set_config", "max_extend_tokens": 1}) == SetConfig(None, 1, None)
    assert parse({"type": "stats", "id": "s"}) == Stats("s")


@pytest.mark.parametrize(
    "frame",
    ["", "not json", "{", "[1, 2]", "3", '"text"', "null", b'{"type": "stats"}', "NaN",
     '{"type": "submit", "prompt": "x", "temperature": NaN}', "[" * 100_000],
)  # fmt: skip
def test_invalid_json(frame: str | bytes) -> None:
    err = error_of(frame)
    assert err.code == "invalid_json" and err.command_id is None


@pytest.mark.parametrize("kind", [None, 3, "Submit", "", ["submit"], "hello"])
def test_unknown_type_echoes_id(kind: object) -> None:
    obj = {"id": "k", "prompt": "x"}
    if kind is not None:
        obj["type"] = kind
    err = error_of(obj)
    assert err.code == "unknown_type" and err.command_id == "k"


@pytest.mark.parametrize(
    "fields",
    [
        {},  # no prompt
        {"prompt": ""},
        {"prompt": 5},
        {"prompt": "ok \ud800"},
        {"prompt": ["a"]},
        {"prompt": "x", "input_ids": [1]},
        {"input_ids": []},
        {"input_ids": [1.0]},
        {"input_ids": [True]},
        {"input_ids": [-1]},
        {"input_ids": [VOCAB]},
        {"input_ids": "1 2"},
        {"input_ids": [1], "chat": True},
        {"prompt": "x", "max_tokens": True},
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "x", "max_tokens": -5},
        {"prompt": "x", "max_tokens": 2.0},
        {"prompt": "x", "max_tokens": "8"},
        {"prompt": "x", "temperature": -0.1},
        {"prompt": "x", "temperature": "hot"},
        {"prompt": "x", "temperature": False},
        {"prompt": "x", "temperature": 10**400},
        {"prompt": "x", "temperature": [0.5]},
        {"prompt": "x", "top_k": 0},
        {"prompt": "x", "top_k": -2},
        {"prompt": "x", "top_k": VOCAB + 1},
        {"prompt": "x", "top_p": 0},
        {"prompt": "x", "top_p": 1.5},
        {"prompt": "x", "top_p": None},
        {"prompt": "x", "ignore_eos": 1},
        {"prompt": "x", "chat": "yes"},
        {"prompt": "x", "seed": -1},
        {"prompt": "x", "seed": 2**63},
        {"prompt": "x", "seed": 1.5},
    ],
)
def test_submit_fields_out_of_range(fields: dict[str, object]) -> None:
    err = error_of({"type": "submit", "id": "s", **fields})
    assert err.code == "invalid_request" and err.command_id == "s", err.message


@pytest.mark.parametrize(
    "obj",
    [
        {"type": "abort"},
        {"type": "abort", "uid": "3"},
        {"type": "abort", "uid": -1},
        {"type": "abort", "uid": False},
        {"type": "set_config", "max_extend_tokens": 0},
        {"type": "set_config", "max_extend_tokens": True},
        {"type": "set_config", "max_extend_tokens": 2**40},
        {"type": "set_config", "policy": "fastest"},
        {"type": "set_config", "policy": None},
        {"type": "stats", "id": 5},
        {"type": "submit", "id": ["a"], "prompt": "x"},
    ],
)
def test_other_commands_invalid(obj: dict[str, object]) -> None:
    assert error_of(obj).code == "invalid_request"


def test_non_string_id_is_not_echoed() -> None:
    assert error_of({"type": "stats", "id": {"x": 1}}).command_id is None
