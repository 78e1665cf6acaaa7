"""The benchmarks: one module per question, each a command with `--help` that prints a table.

    python -m bench.throughput       engine against Hugging Face generate, mixed-length prompts
    python -m bench.stall            chats decoding while a long prompt arrives, both policies
    python -m bench.sweep            one workload under each (policy, budget): traces, summary, figure
    python -m bench.step             the engine's own CPU time per decode step
    python -m bench.schedule         schedule() with a long waiting queue against a short one
    python -m bench.admission        reserve against optimistic admission
    python -m bench.precision        bf16 against float32 logits, and chunked against unchunked
    python -m bench.sampler          the sampler's cost per decode step
    python -m bench.server_overhead  the server and a client against the bare engine
    python -m bench.http             HTTP streams against the engine alone
    python -m bench.serving          guidellm against a fresh server
    python -m bench.vs_vllm          stepscope against vLLM, same model and load
    python -m bench.fleet            the Model Gateway's routing policies over replicas
    python -m bench.page_rate        does the page keep up with the engine; one update's cost
    python -m bench.soak             memory, step time and integrity over a long run
    python -m bench.counterfactual   does a request's delay name the time a long prompt cost it
    python -m bench.gpu              everything above that needs CUDA, in one run (sections)
    python -m bench.tp               tensor parallelism on two GPUs: exactness and step time

The tools build on the product (engine, instrumentation, app) and never on the tests. What
they measured, and the commands that measured it, is in docs/benchmarks.md.
"""
