"""Tests of the instrumentation layer."""
