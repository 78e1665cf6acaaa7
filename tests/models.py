"""Tiny random-weight Hugging Face models for tests: checks.models, which the scripts
share (scripts never import tests)."""

from checks.models import ARCHS, TINY_COMMON, make_tiny, make_wide_model

__all__ = ["ARCHS", "TINY_COMMON", "make_tiny", "make_wide_model"]
