"""One run of everything the benchmarks measure on CUDA, for any CUDA machine.

    python -m bench.gpu [--sections decode,chunk,...] [--out DIR]

It first builds FlashInfer's JIT kernels in parallel (FlashInfer is optional: without it the
engine runs torch attention, and what compares against FlashInfer says it is skipped), then
runs the sections in order, each isolated (one failing prints its traceback and the rest still
run). The model is Qwen3-0.6B's shape with random bf16 weights (assets/qwen3-0.6b: a config,
no download); the exactness section adds the bundled SmolLM2's real weights when they are here.

  decode     decode steps at batch 1 and 64 (512-token prompts, 128 new tokens) against the
             memory floor at the copy rate measured in the same run, engine options beside the
             default, a host profile of the steps; Hugging Face generate (its default cache,
             and a static one) at the same shapes
  chunk      the step period of a long prompt's 512- and 2,048-token chunks, their FLOP/s
             against the bf16 matmul rate measured in the run, and a 512-token chunk step's
             kernels (torch.profiler)
  mixed      64 decodes + a 512-token chunk in one step against the decode step alone, its
             kernels; host-device synchronizations during overlapped steps
  serving    the server and a client against the bare engine (bench.server_overhead), and
             HTTP streams against the engine alone (bench.http)
  stall      a long prompt arriving among 32 decoding requests: TTFT, the decoders' steady and
             worst gaps, both policies at budgets 128 to 8,192
  exactness  chunked against unchunked greedy tokens; the engine's logits against Hugging
             Face's on the same weights; FlashInfer against torch attention per step kind;
             batch-invariant and float32-residual runs; SmolLM2's real weights when here
  kernels    the skinny matmuls and the decode attention kernel tuned against cuBLAS and
             FlashInfer (OUT/gemv_tuned.json, OUT/decode_tuned.json: the tables the engine
             ships per device), and a decode step's kernels with the fused kernels off and on

Random-weight models sample ids the bundled tokenizer does not know; the engine's detokenizer
folds them into its vocabulary, so detokenizing costs what it would for a real model. Each
section prints its tables; OUT/bench_gpu.md has them all and OUT/bench_gpu.json the raw
numbers, both rewritten after every section.
"""
