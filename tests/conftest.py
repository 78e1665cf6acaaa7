"""Shared fixtures: tiny random Llama and Qwen3 model directories, and the bundled SmolLM2."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models import make_tiny


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The bundled model, converted once into the stepscope cache."""
    from engine.models.loader import resolve

    return resolve("smollm2", progress=False).path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return make_tiny("llama", tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return make_tiny("qwen3", tmp_path_factory.mktemp("tiny-qwen3"), smollm2_dir)
