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
    waits for the device, so on CUDA the host can go on while the tokens are computed.

    Greedy rows take the argmax; the others are sampled together, a fixed number of kernels
    per step rather than a dozen per row (on a GPU, 64 sampled rows one by one made the step
    6x as long), plus one per seeded row: its own generator's noise, drawn over the whole
    vocabulary, so its sequence is its seed's whatever else shares the batch."""
    import torch

    out = logits.argmax(dim=-1)
    vocab = logits.shape[-1]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    # rows with a top-k draw from their top candidates only (no sort of the whole vocabulary)
    for group in (
        [i for i in sampled if 0 < params[i].top_k < vocab],
        [i for i in sampled if not 0 < params[i].top_k < vocab],
    ):
        if group:
            index = _on(torch.tensor(group), logits.device)
            picked = _draw(logits.index_select(0, index), [params[i] for i in group],
                           [generators[i] for i in group])  # fmt: skip
            out.index_copy_(0, index, picked)
    return out


def _draw(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """One token per row of `logits` [n, vocab] under each row's params: temperature, then
    top-k, min-p and top-p, as vLLM applies them."""
    import torch

    dev = logits.device
    vocab = logits.shape[-1]
    # float64 and the max subtracted first: a tiny temperature (1e-300 is valid) must not
    # overflow into inf - inf = NaN; it tends to greedy, as it should
    rows = logits.double()
    rows = rows - rows.amax(dim=-1, keepdim=True)
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float64)
    rows = rows / _on(temps, dev)[:, None]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    ids = None  # the token of each column, once the columns are no longer the vocabulary
    if max(ks) < vocab:  # every row has a top-k: its candidates, sorted, are all it needs
        rows, ids = torch.topk(rows, max(ks), dim=-1)
        beyond = torch.arange(max(ks), device=dev)[None, :] >= _on(torch.tensor(ks), dev)[:, None]
        rows = rows.masked_fill(beyond, float("-inf"))
    elif any(p.top_p < 1.0 for p in params):  # top-p needs the mass in descending order
        rows, ids = torch.sort(rows, dim=-1, descending=True)
    probs = torch.softmax(rows, dim=-1)
    if any(p.min_p > 0 for p in params):  # after temperature, as vLLM and Hugging Face apply it
        min_p = _on(torch.tensor([p.min_p for p in params], dtype=torch.float64), dev)[:, None]
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    if any(p.top_p < 1.0 for p in params):
        top_p = _on(torch.tensor([p.top_p for p in params], dtype=torch.float64), dev)[:, None]
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        probs = probs.masked_fill(probs.cumsum(-1) - probs > top_p, 0.0)
    # The exponential race: argmax of p / Exp(1) picks i with probability p_i / sum(p), as
    # torch.multinomial would, without its wait for the device (the step in flight)
    seeded = [j for j, g in enumerate(generators) if g is not None]
    if not seeded:
        race = torch.empty(probs.shape, dtype=torch.float32, device=dev).exponential_()
    else:  # a seeded row's noise is its generator's, token by token
        race = torch.empty((len(params), vocab), dtype=torch.float32, device=dev)
        if len(seeded) < len(params):
            race.exponential_()
        for j in seeded:
            race[j].exponential_(generator=generators[j])
        if ids is not None:
            race = race.gather(1, ids)
    # a draw of exactly 0 would make 0 / 0 = NaN, which argmax takes as the largest
    race = race.clamp_(min=torch.finfo(torch.float32).tiny)
    picked = (probs / race).argmax(dim=-1, keepdim=True)
    return (picked if ids is None else ids.gather(1, picked)).view(-1)


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without a wait: a pageable copy to a GPU first waits
    for everything queued on the stream (the step in flight)."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


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
