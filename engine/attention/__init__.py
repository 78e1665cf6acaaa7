"""Attention backends behind one small interface: torch (CPU, and CUDA fallback), FlashInfer (CUDA)."""
