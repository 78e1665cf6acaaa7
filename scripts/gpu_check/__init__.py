"""The GPU check: one command, one device call. JIT warm-up, correctness, benchmarks, tables.

    PYTHONPATH=. python3 -m scripts.gpu_check --out OUT [--sections a,b,...]

One module per section (main.py runs them; common.py and report.py are what they share); the
checks it shares with the tests are in engine/checks/, since scripts never import the tests.

Sections, in order (each isolated: one failing prints its traceback and the rest still run):
  warmup     build FlashInfer's JIT kernels in parallel threads (norm, RoPE, SiLU, attention)
  pytest     tests/gpu/test_gpu.py
  bandwidth  device-to-device copy rate, the denominator of every memory floor
  logits     engine vs Hugging Face, last-position logits, Qwen3-0.6B shape with random weights
  backends   FlashInfer vs torch attention inside the engine, per step kind (prefill/mixed/decode)
  chunked    chunked vs unchunked prefill, greedy tokens of 32 prompts
  kernels    per-kernel breakdown of a decode step at batch 1 and 64 (torch.profiler), eager
             and through the CUDA graphs; run bandwidth first for the GB/s column
  gap        issue 17's SmolLM2 logits gap: a SmolLM2-shaped model's logits per attention
             backend against HF, then FlashInfer's attention alone, one plan choice at a time
  bench      engine decode steps at batch 1/16/64/256 (512-token prompts, 128 new tokens)
  overhead   the same steps with a JSON hook, and with the WebSocket server and one client
  stall      the stall table: an 8,000-token prompt arriving among 32 decoding requests
  hf         Hugging Face generate with its default cache, same shapes
  hf_static  Hugging Face generate with a static cache (compiled by generate on first use)
  smollm2    the bundled SmolLM2 (if its weights are here): logits vs HF, chunked, backends

Random-weight models sample token ids the bundled tokenizer does not know; the engine's
detokenizer is swapped for one that folds ids into that vocabulary, so detokenizing costs what
it would for a real model (the Rust incremental decoder, one call a token). Markdown tables go to stdout and OUT/gpu_check.md, raw numbers to
OUT/gpu_check.json, both rewritten after every section.
"""
