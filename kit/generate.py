"""Speculative generation in one process: prefill -> (draft -> verify pass -> verify -> commit)*.

The distributed runtime runs exactly these steps, with the verify pass cut across processes. The
target's cache holds every committed token but the last; a round feeds [last, d1..dK] at position
n-1, so the verdict rewinds every stage to the same integer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kit.graphs import StageRunner
from kit.verify import Sampling, verify


@dataclass
class AdaptiveK:
    """Pick K each round to maximise expected tokens per unit time from recent acceptance.

    With per-token acceptance a, a round of K drafts commits (1 - a^(K+1)) / (1 - a) tokens and costs
    `fixed_ms + per_draft_ms * K` (network + stage compute, and the draft and verify work per token).
    """

    k_min: int = 1
    k_max: int = 8
    fixed_ms: float = 100.0
    per_draft_ms: float = 3.0
    alpha: float = 0.7
    decay: float = 0.8

    def update(self, proposed: int, accepted: int) -> None:
        if proposed:
            rate = accepted / proposed if accepted < proposed else min(0.98, (accepted + 1) / (proposed + 1))
            self.alpha = self.decay * self.alpha + (1 - self.decay) * rate

    def measure(self, fixed_ms: float, draft_ms: float, k: int) -> None:
        """Learn a round's cost from the last one: the part that does not grow with K (network, stage
        passes) and the drafting time per draft token (when drafting was not hidden under the network)."""
        self.fixed_ms = self.decay * self.fixed_ms + (1 - self.decay) * fixed_ms
        if k and draft_ms > 0:
            self.per_draft_ms = self.decay * self.per_draft_ms + (1 - self.decay) * draft_ms / k

    def choose(self) -> int:
        a = min(self.alpha, 0.99)
        return max(range(self.k_min, self.k_max + 1),
                   key=lambda k: (1 - a ** (k + 1)) / (1 - a) / (self.fixed_ms + self.per_draft_ms * k))


@dataclass
class Round:
    k: int
    accepted: int
    committed: int
    draft_ms: float
    verify_ms: float


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str
    rounds: list[Round] = field(default_factory=list)
    ttft_ms: float = 0.0
    seconds: float = 0.0


def finish(new: list[int], generated: int, max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], str | None]:
    """Cut a verdict's committed tokens at the first EOS (kept) or at max_new_tokens, whichever comes first."""
    room = max(0, max_new_tokens - generated)
    for i, t in enumerate(new[:room]):
        if t in eos_ids:
            return new[: i + 1], "eos"
    if len(new) >= room:
        return new[:room], "length"
    return new, None


def commit(out: list[int], verdict: list[int], max_new_tokens: int, eos_ids: set[int],
           stop: Callable[[list[int]], int | None] | None = None) -> str | None:
    """Append a verdict's tokens to `out` (in place) as target-only decoding would have produced them:
    up to the first EOS (kept) or max_new_tokens, and up to where `stop` cuts, asked after each token
    (the cut may fall inside earlier rounds' tokens). Returns the finish reason, or None to go on."""
    new, reason = finish(verdict, len(out), max_new_tokens, eos_ids)
    if stop:  # EOS or the limit end the last token, so stop is not asked about it
        for i in range(1, len(new) + (reason is None)):
            cut = stop(out + new[:i])
            if cut is not None:
                out[:] = (out + new[:i])[:cut]
                return "stop"
    out += new
    return reason


def prefill(runners: list[StageRunner], ids: list[int], chunk: int = 256) -> None:
    """Write ids into every stage's cache from slot 0, a chunk at a time (eagerly: shapes vary)."""
    dev = runners[0].stage.device
    for r in runners:
        r.stage.rewind(0)
    for s in range(0, len(ids), chunk):
        x = torch.tensor(ids[s : s + chunk], device=dev)
        for r in runners:
            x = r.stage.step(x)


def verify_pass(runners: list[StageRunner], tokens: list[int], start: int) -> torch.Tensor:
    """Run [last, d1..dK] through all stages at `start`; logits [K+1, V]."""
    x = torch.tensor(tokens, device=runners[0].stage.device)
    for r in runners:
        x = r(x, start)
    return x[0]


def generate(runners: list[StageRunner], drafter, prompt: list[int], *, max_new_tokens: int, k: int = 4,
             sampling: Sampling = Sampling(), eos_ids: set[int] | None = None,
             stop: Callable[[list[int]], int | None] | None = None, adaptive: AdaptiveK | None = None) -> Generation:
    """Generate up to max_new_tokens after `prompt`; output equals target-only decoding (greedy), or
    follows the target's distribution (sampling)."""
    if not prompt:
        raise ValueError("the prompt is empty")
    eos_ids = eos_ids or set()
    t0 = time.perf_counter()
    prefill(runners, prompt[:-1])
    context, out, result = list(prompt), [], Generation([], "length")
    max_len = runners[0].stage.max_len
    while len(out) < max_new_tokens:
        n = len(context)
        if n >= max_len:
            result.finish_reason = "length"
            break
        want = adaptive.choose() if adaptive else k
        want = max(0, min(want, max_new_tokens - len(out) - 1, max_len - n - 1))  # context never passes max_len
        t1 = time.perf_counter()
        drafts = drafter.propose(context, want) if want else []
        t2 = time.perf_counter()
        logits = verify_pass(runners, [context[-1], *drafts], n - 1)
        accepted, nxt = verify(logits, drafts, sampling, n)
        t3 = time.perf_counter()
        if adaptive:
            adaptive.update(len(drafts), accepted)
        before = len(out)
        reason = commit(out, drafts[:accepted] + [nxt], max_new_tokens, eos_ids, stop)
        context[len(prompt):] = out
        if not result.rounds:
            result.ttft_ms = (t3 - t0) * 1000
        result.rounds.append(Round(len(drafts), accepted, len(out) - before, (t2 - t1) * 1000, (t3 - t2) * 1000))
        if reason:
            result.finish_reason = reason
            break
    result.token_ids = out
    result.seconds = time.perf_counter() - t0
    return result
