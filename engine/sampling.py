"""The sampler: logits to tokens, under each request's SamplingParams; and the log-probabilities
of chosen tokens with their top alternatives (for OpenAI's `logprobs`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from instrumentation.sampling import SamplingParams

if TYPE_CHECKING:
    import torch


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """One token per row of `logits`, as an int64 tensor on the logits' device. Nothing here
    waits for the device, so on CUDA the host can go on while the tokens are computed."""
    import torch

    out = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        # float64 and the max subtracted first: a tiny temperature (1e-300 is valid) must not
        # overflow into inf - inf = NaN; it tends to greedy, as it should
        row = logits[i].double()
        row = (row - row.max()) / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.min_p > 0:  # after temperature, as vLLM and Hugging Face apply it
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = sorted_p.cumsum(0) - sorted_p > p.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        out[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    return out


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-softmax of each row of float `logits` [n, vocab]: the log-probability of `targets`
    [n] (int64), and the top `k` log-probabilities with their token ids ([n, k] each). Raw: the
    model's distribution, before temperature and filters (vLLM's default). On the device."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, targets.view(-1, 1)).view(-1)
    top = torch.topk(logp, k, dim=-1) if k > 0 else None
    empty = logp.new_empty((logp.shape[0], 0))
    if top is None:
        return chosen, empty, empty.long()
    return chosen, top.values, top.indices
