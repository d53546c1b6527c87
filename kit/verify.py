"""The one verifier: greedy exact match, or lossless speculative rejection sampling.

Random draws are keyed by (seed, position), not by a running generator, so a sampled answer does
not depend on how tokens were grouped into rounds, resent after a fault, or which process drew them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def warp(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Probabilities [N, V] after temperature, top-k and top-p; applied alike to target and drafter."""
    x = logits.float() / s.temperature
    if s.top_k and s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if s.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        sorted_p = sorted_p.masked_fill(before >= s.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _generator(s: Sampling, position: int, salt: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((s.seed * 1_000_003 + position * 7919 + salt) % (2**63))
    return g


def sample(probs: torch.Tensor, s: Sampling, position: int, salt: int = 0) -> int:
    """Draw one token from probs [V] with the draw keyed by (seed, position, salt)."""
    return int(torch.multinomial(probs, 1, generator=_generator(s, position, salt, probs.device)))


def verify(logits: torch.Tensor, drafts: list[int], s: Sampling, position: int,
           draft_probs: torch.Tensor | None = None) -> tuple[int, int]:
    """Accept a prefix of `drafts` [K] against target logits [K+1, V]; return (accepted, next token).

    `position` is the sequence position of the first draft. `draft_probs` [K, V] are the drafter's
    warped probabilities; None means the drafts were deterministic (a point mass on each draft), as
    for argmax model drafts and n-gram lookup. Greedy: accept while drafts equal the target argmax.
    Sampling: accept draft d with probability min(1, p(d)/q(d)); on the first rejection draw from
    max(p - q, 0) renormalised; after K acceptances draw the bonus token from p.
    """
    K = len(drafts)
    if s.greedy:
        target = logits.argmax(-1).tolist()  # the round's one host sync
        accepted = 0
        while accepted < K and drafts[accepted] == target[accepted]:
            accepted += 1
        return accepted, target[accepted]
    p = warp(logits, s)  # [K+1, V]
    d = torch.tensor(drafts, device=p.device, dtype=torch.long)
    idx = torch.arange(K, device=p.device)
    p_d = p[idx, d].tolist()
    q_d = draft_probs[idx.to(draft_probs.device), d.to(draft_probs.device)].tolist() if draft_probs is not None else [1.0] * K
    accepted = 0
    while accepted < K:
        u = torch.rand(1, generator=_generator(s, position + accepted, 1, torch.device("cpu"))).item()
        if u * q_d[accepted] >= p_d[accepted]:  # reject unless u < p/q
            break
        accepted += 1
    if accepted == K:
        return K, sample(p[K], s, position + K)
    if draft_probs is None:
        residual = p[accepted].clone()
        residual[drafts[accepted]] = 0.0
    else:
        residual = (p[accepted] - draft_probs[accepted].to(p.device)).clamp_min(0.0)
    total = residual.sum()
    if total <= 0:  # p == q up to rounding: a rejection had probability ~0, and p itself is the right law
        residual, total = p[accepted], 1.0
    return accepted, sample(residual / total, s, position + accepted)


def next_token(logits: torch.Tensor, s: Sampling, position: int) -> int:
    """Target-only decoding of the token at `position` from logits [V]: the same rule with K = 0."""
    return verify(logits[None], [], s, position)[1]
