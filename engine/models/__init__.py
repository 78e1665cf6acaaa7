"""Decoder-only transformer models (Llama, Qwen2, Qwen3) and their weight loading."""
