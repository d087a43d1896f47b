"""Next-token choice: greedy, or temperature + nucleus (top-p) sampling from a per-request
torch.Generator, so a request with a seed gives the same tokens on every layout and every run."""

from __future__ import annotations

import torch


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    """One token from `logits` (V,). temperature == 0 is greedy (argmax); otherwise softmax(logits / T)
    restricted to the smallest set of most likely tokens whose mass reaches top_p (Holtzman et al. 2020)."""
    logits = logits.float().cpu()
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep a token while the mass before it is below top_p: the first token is always kept.
        keep = (torch.cumsum(sorted_p, 0) - sorted_p) < top_p
        sorted_p = sorted_p * keep
        return int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)])
    return int(torch.multinomial(probs, 1, generator=gen))
