"""Tiny random-weight Hugging Face models for tests: engine.checks.models, which the scripts
share (scripts never import tests)."""

from engine.checks.models import ARCHS, TINY_COMMON, make_tiny, make_wide_model

__all__ = ["ARCHS", "TINY_COMMON", "make_tiny", "make_wide_model"]
