"""Every engine setting is written once (engine.config.EngineConfig): `LLM(...)`'s keyword
arguments and `python -m engine.server --help` are generated from it, with the same defaults."""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest

from engine import LLM
from engine.config import EngineConfig, LiveConfig
from engine.server import ServerArgs, build_parser, parse_args
from instrumentation.errors import InvalidRequest

SETTINGS = [f for f in fields(EngineConfig)]


def _options() -> dict[str, object]:
    """dest -> default of every option of the server's parser."""
    return {a.dest: a.default for a in build_parser()._actions if a.dest != "help"}


def test_every_setting_is_an_llm_argument_with_its_default() -> None:
    params = inspect.signature(LLM).parameters
    assert set(params) == {f.name for f in SETTINGS} | {"progress"}
    for f in SETTINGS:
        assert params[f.name].default == f.default, f.name


def test_every_setting_is_a_server_option_with_its_default() -> None:
    options = _options()
    help_text = build_parser().format_help()
    for f in SETTINGS:
        assert options[f.name] == f.default, f.name
        assert "--" + f.name.replace("_", "-") in help_text
    # and nothing the server parses is unknown to its settings
    assert set(options) == {f.name for f in fields(ServerArgs)}


def test_the_command_line_builds_the_same_config() -> None:
    args = parse_args(["--max-extend-tokens", "64", "--no-cuda-graph", "--policy", "mixed"])
    cfg = args.engine()
    assert type(cfg) is EngineConfig
    assert cfg == EngineConfig(max_extend_tokens=64, cuda_graph=False, policy="mixed")
    assert cfg.live() == LiveConfig(64, "mixed")
    assert parse_args([]).engine() == EngineConfig()
    assert parse_args(
        ["--allow-origin", "http://a", "--allow-origin", "http://b"]
    ).allow_origin == (
        "http://a",
        "http://b",
    )
    assert parse_args(["--http-port", "none"]).http_port is None


def test_bad_values_are_refused_by_both(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InvalidRequest, match="max_running_req must be an integer >= 1"):
        EngineConfig(max_running_req=0)
    with pytest.raises(InvalidRequest, match="unknown policy 'fastest'"):
        EngineConfig(policy="fastest")
    with pytest.raises(TypeError, match="unknown setting.*max_extend_token\\b"):
        LLM(max_extend_token=8)  # a typo is not silently a default
    for argv in (["--page-size", "0"], ["--policy", "fastest"], ["--host", "0.0.0.0"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
    assert "not loopback" in capsys.readouterr().err


def test_device_defaults_are_resolved_in_the_config() -> None:
    cpu = EngineConfig().resolve(cuda_available=False)
    assert (cpu.device, cpu.dtype, cpu.page_size, cpu.overlap) == ("cpu", "float32", 1, False)
    cuda = EngineConfig(device="auto").resolve(cuda_available=True)
    assert (cuda.device, cuda.dtype, cuda.page_size, cuda.overlap) == ("cuda", "bfloat16", 16, True)
    assert EngineConfig(device="auto").resolve(cuda_available=False).device == "cpu"
    mine = EngineConfig(page_size=4, overlap=False, dtype="float16").resolve(True)
    assert (mine.page_size, mine.overlap, mine.dtype) == (4, False, "float16")
    assert EngineConfig(batch_invariant=True).resolve(True).attention_backend == "triton"
    with pytest.raises(InvalidRequest, match="CUDA is not available"):
        EngineConfig(device="cuda").resolve(cuda_available=False)
