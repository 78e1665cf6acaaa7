"""Tests of the gpu layer."""
