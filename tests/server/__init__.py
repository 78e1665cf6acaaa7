"""Tests of the server layer."""
