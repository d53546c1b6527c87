"""Drafters: a small model, the target's own first layers (`self:L`), prompt lookup (`ngram`), `none`.

Every drafter answers `propose(context, k) -> list[int]` with up to k tokens that continue the
committed `context`. Drafts are deterministic (argmax of the drafter, or a lookup), so the verifier
treats the draft distribution as a point mass and only token ids ever cross the network.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from kit import kernels as fused_kernels
from kit.graphs import DeviceClock, capture, compile_mode, compiled, scratch_tail, span
from kit.load import CheckpointError, load_config, load_stage, read_tensors, resolve
from kit.model import Stage

CATCH_UP = 16  # context tokens a draft graph feeds before drafting; longer gaps take one eager pass first


class NoDrafter:
    """Plain decoding: one token per round."""

    def propose(self, context: list[int], k: int) -> list[int]:
        return []


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens, copy what followed."""

    def __init__(self, max_n: int = 3):
        self.max_n = max_n

    def propose(self, context: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(context) - 1), 0, -1):
            tail = context[-n:]
            for i in range(len(context) - n - 1, -1, -1):
                if context[i:i + n] == tail:
                    return context[i + n:i + n + k]
        return []


class ModelDrafter:
    """Greedy drafts from a small causal LM kept in its own static KV cache.

    The cache holds exactly the tokens in `fed`; each call rewinds it to the longest prefix shared with
    the new context, feeds the rest (after a fully accepted round that includes the last draft, so the
    context has no hole) and runs the k-step loop. On CUDA the loop is one graph per k (and attention
    span, see kit.graphs): static token and position buffers, argmax on the device, one host sync for
    the k tokens. Each step is our Triton kernels (kit.kernels: five per layer) where they run, else
    PyTorch ops, torch.compile'd with `compile`.
    """

    def __init__(self, stage: Stage, vocab_limit: int, graphs: bool | None = None,
                 compile: bool | str | None = None, kernels: bool | None = None):
        if not (stage.first and stage.last):
            raise ValueError("a drafter needs the embedding, its layers, the norm and the head")
        self.stage, self.vocab_limit = stage, vocab_limit
        self.graphs = stage.device.type == "cuda" if graphs is None else graphs
        # one step as our Triton kernels (kit.kernels) where they run: by default inside CUDA graphs
        self.kernels = (self.graphs if kernels is None else kernels) and fused_kernels.available(stage)
        self.compile = compile_mode(stage, compile) if self.graphs and not self.kernels else None
        self._step_fn = compiled(self._step, self.compile) if self.compile else self._step
        self.fed: list[int] = []
        # per catch-up count c (0..CATCH_UP): (k, span) -> (graph, token buffer [c + 1], start, drafts, logits [k, V])
        self._captured: dict[int, dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor,
                                                                torch.Tensor, torch.Tensor]]] = {0: {}}
        self.logits: torch.Tensor | None = None  # [k, vocab_limit] of the last propose, until the next one
        self._pool = None
        self.clock = DeviceClock(stage.device)  # the last draft's device time: clock.ms(), None off CUDA

    def propose(self, context: list[int], k: int) -> list[int]:
        self.clock.reset()
        self.logits = None
        if k <= 0 or not context:
            return []
        stage = self.stage
        if len(context) + k > stage.max_len:
            return []
        n_vocab = stage.cfg.vocab_size  # ids beyond the drafter's embedding (target-only padding) read as 0
        if max(context) >= n_vocab:
            context = [t if t < n_vocab else 0 for t in context]
        limit = min(len(self.fed), len(context) - 1)  # the last context token always goes through the loop
        # rounds differ from what the cache holds only near the end: compare the long shared part at C speed
        common = max(0, limit - 64)
        if self.fed[:common] != context[:common]:
            common = 0
        while common < limit and self.fed[common] == context[common]:
            common += 1
        stage.rewind(common)
        feed = context[common:]  # tokens the cache lacks; the last one starts the loop
        self.clock.mark(0)
        if len(feed) > (CATCH_UP if self.graphs else 1) + 1:  # a prompt or a replay: one eager pass. A few
            # catch-up tokens (the last draft after a fully accepted round; a round drafted on a runner-up
            # branch and its correction) ride in the graph, a step each
            stage.step(torch.tensor(feed[:-2], device=stage.device))
            common, feed = len(context) - 2, feed[-2:]
        drafts = self._loop(feed, common, k)
        self.fed = context + drafts[:-1]
        stage.length = len(self.fed)
        return drafts

    def top(self, m: int) -> tuple[list[list[int]], list[list[float]]]:
        """The m likeliest tokens and their log-probabilities at each step of the last `propose`. Where
        the target rejects a draft, its own token is often the drafter's runner-up there: a branch worth
        drafting on while the round is out (kit.node)."""
        if self.logits is None:
            return [], []
        best, ids = self.logits.topk(min(m, self.logits.shape[-1]), -1)
        return ids.tolist(), (best - self.logits.logsumexp(-1, keepdim=True)).tolist()

    @contextlib.contextmanager
    def aside(self, start: int, n: int):
        """Draft off the main line inside this block (guessed branches): afterwards the cache slots
        start..start+n-1 and the record of what the cache holds are back as before, so the main line's
        next draft still feeds one or two tokens through the graph, not an eager catch-up pass."""
        stage, fed = self.stage, list(self.fed)
        end = min(start + n, stage.max_len)
        saved = [(k[:, :, start:end].clone(), v[:, :, start:end].clone())
                 for k, v in zip(stage.k_caches, stage.v_caches)]
        try:
            yield
        finally:
            for k, v, (k_saved, v_saved) in zip(stage.k_caches, stage.v_caches, saved):
                k[:, :, start:end].copy_(k_saved)
                v[:, :, start:end].copy_(v_saved)
            self.fed, self.logits = fed, None
            stage.length = len(fed)

    def _step(self, tok: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        logits.copy_(self.stage(tok, pos, pos, (slots <= pos)[None, :])[0, -1, : self.vocab_limit])
        return argmax(logits)

    def _body(self, toks: torch.Tensor, start: torch.Tensor, out: torch.Tensor, logits: torch.Tensor, k: int,
              S: int) -> None:
        """Feed toks [c + 1] from position `start` (the first c only fill the cache), then draft k (their
        logits into logits [k, V])."""
        if self.kernels:
            fused_kernels.draft(self.stage, toks, start, out[:k], logits, S, self.vocab_limit)
            return
        slots = torch.arange(S, device=self.stage.device)
        torch._dynamo.maybe_mark_dynamic(slots, 0)
        pos = start.clone()
        for i in range(toks.shape[0] - 1):
            self._step_fn(toks[i : i + 1], pos, slots, logits[0])
            pos = pos + 1
        tok = toks[-1:]
        for i in range(k):
            tok = self._step_fn(tok, pos, slots, logits[i])
            out[i : i + 1].copy_(tok)
            pos = pos + 1

    def _loop(self, feed: list[int], start: int, k: int) -> list[int]:
        dev, c = self.stage.device, len(feed) - 1
        if not self.graphs:
            out = torch.empty(k, dtype=torch.long, device=dev)
            self.logits = torch.empty(k, self.vocab_limit, device=dev)
            self._body(torch.tensor(feed, device=dev), torch.tensor([start], device=dev), out, self.logits, k,
                       start + c + k)
            self.clock.mark(1)
            return out.tolist()
        captured = self._captured.setdefault(c, {})
        # exactly k steps: a longer loop would serve too, but every extra step costs the round a drafter
        # step (the 9-step pre-draft once served the 8-step drafts after a verdict); capturing is cheap,
        # the step's kernels (or compiled code) do not depend on k
        key = (k, span(start + c + k, self.stage.max_len))
        if key not in captured:
            try:
                self._capture(c, *key)
            except Exception as e:  # Triton compiles on first use: a GPU or version it fails on keeps PyTorch
                if not self.kernels:
                    raise
                print(f"[drafter] Triton kernels failed ({type(e).__name__}: {str(e)[:200]}); "
                      "drafting with PyTorch ops", file=sys.stderr)
                self.kernels = False
                self._capture(c, *key)
        graph, toks, start_t, out, self.logits = captured[key]
        toks.copy_(torch.tensor(feed), non_blocking=True)
        start_t.fill_(start)
        with torch.cuda.device(dev):  # the drafter may live on another GPU than the stage
            graph.replay()
        self.clock.mark(1)
        return out[:k].tolist()

    def _capture(self, c: int, k: int, S: int) -> None:
        dev, stage = self.stage.device, self.stage
        toks = torch.zeros(c + 1, dtype=torch.long, device=dev)
        start = torch.full((1,), stage.max_len - c - k, dtype=torch.long, device=dev)
        out = torch.zeros(k, dtype=torch.long, device=dev)
        logits = torch.zeros(k, self.vocab_limit, device=dev)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with scratch_tail(stage, c + k):
            graph, _ = capture(lambda: self._body(toks, start, out, logits, k, S), self._pool, dev)
        self._captured[c][k, S] = (graph, toks, start, out, logits)


def argmax(x: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Index [1] of the largest entry of x [V], the first one on ties as `torch.argmax`, found as two
    reductions (the maximum of each chunk, then the best chunk): a single reduction over a 150k
    vocabulary runs on one GPU block, ~30 us on an H200, an eighth of a 0.5B drafter's step."""
    rows = -(-x.shape[0] // chunk)
    best, at = F.pad(x, (0, rows * chunk - x.shape[0]), value=float("-inf")).view(rows, chunk).max(-1)
    row = best.argmax(-1, keepdim=True)
    return row * chunk + at[row]


def tokenizer_signature(folder: Path) -> dict:
    """The vocabulary a checkpoint's tokenizer maps text to (token -> id), without loading weights."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:
        raise CheckpointError(f"cannot read the tokenizer in {folder}: {e}") from None
    return tok.get_vocab()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def check_same_tokenizer(target: str, draft: str) -> None:
    """Refuse a drafter whose tokenizer maps text to other ids than the target's (before loading weights).
    Two checkpoints without any tokenizer (id-only benchmarks) have nothing to compare."""
    t_dir, d_dir = resolve(target), resolve(draft)
    has = [any((d / f).is_file() for f in TOKENIZER_FILES) for d in (t_dir, d_dir)]
    if not any(has):
        return
    if not all(has):
        raise CheckpointError(f"only one of target {target} and drafter {draft} has a tokenizer: cannot check "
                              "that they share one")
    t_vocab, d_vocab = tokenizer_signature(t_dir), tokenizer_signature(d_dir)
    differ = [tok for tok, i in d_vocab.items() if t_vocab.get(tok, i) != i]
    missing = len(set(d_vocab) ^ set(t_vocab))
    if differ or missing > 0.01 * len(t_vocab):
        raise CheckpointError(
            f"drafter {draft} uses a different tokenizer than target {target} "
            f"({len(differ)} tokens map to other ids, {missing} tokens only in one): pick a drafter of the same family"
        )


def make_drafter(spec: str, target: str, stage0: Stage | None = None, *, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", max_len: int = 4096, progress: bool = True):
    """Build the drafter named by `spec`: none, ngram, self:L, or a checkpoint (folder, hub id, GGUF)."""
    if spec in ("none", "", None):
        return NoDrafter()
    if spec == "ngram":
        return NgramDrafter()
    target_cfg = load_config(target)
    if spec.startswith("self:"):
        n = int(spec.split(":", 1)[1])
        if stage0 is None or not stage0.first or not 0 < n <= len(stage0.layers):
            have = len(stage0.layers) if stage0 is not None else 0
            raise ValueError(f"self:{n} needs the first {n} target layers on this node; it holds {have}")
        with torch.device("meta"):
            stage = Stage(target_cfg, 0, n, first=True, last=True)
        stage.embed_tokens = stage0.embed_tokens
        stage.layers = torch.nn.ModuleList(stage0.layers[:n])
        read_tensors(target, stage, ["norm.weight", "lm_head.weight"], dtype=dtype, device=device)
        stage.setup_cache(max_len)
        stage.eval().requires_grad_(False)
    else:
        check_same_tokenizer(target, spec)
        cfg = load_config(spec)
        stage = load_stage(spec, 0, cfg.n_layers, dtype=dtype, layer_devices=[device] * cfg.n_layers,
                           max_len=max_len, progress=progress)
    return ModelDrafter(stage, vocab_limit=min(stage.cfg.vocab_size, target_cfg.vocab_size))

