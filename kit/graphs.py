"""Fixed-shape passes of a stage, captured as CUDA graphs per token count (eager on CPU).

A round always writes T tokens as a chain starting at some cache slot; only the inputs and the start
change, so the positions, slots and mask are computed on the device from one start tensor and the
whole pass replays without host work. Attention covers the first S cache slots, S the power of two
(at least 256) that holds the chain, so short contexts do not pay for the whole cache: one graph per
(T, S), at most log2(max_len / 128) of them per token count.

With `compile`, the pass is first fused by `torch.compile` (q/k/v and gate/up joined, elementwise
work folded into few kernels) and the compiled code is then captured into the same CUDA graph, as
gpt-fast does: the graph removes launch gaps, the compiler removes launches. S is a dynamic size to
the compiler, so every S shares one compilation (S = max_len, a full-cache slice, gets its own).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from kit.model import Stage

MIN_SPAN = 256


def span(n: int, max_len: int) -> int:
    """Cache slots a graph attends over to hold n: the next power of two, at least MIN_SPAN, at most max_len."""
    return min(max_len, max(MIN_SPAN, 1 << (n - 1).bit_length()))


def compile_mode(stage: Stage, compile: bool | str | None) -> str | None:
    """The torch.compile mode for `stage`'s graphs, or None for none; joins the stage's projections
    (`Stage.fuse`) when it compiles. NF4 stages are not compiled: bitsandbytes does not trace.

    `compile`: True (default mode), a mode name, False, or None for the KIT_COMPILE environment
    variable (0/1 or a mode name), off when unset."""
    if compile is None:
        compile = os.environ.get("KIT_COMPILE", "0")
        compile = {"0": False, "1": True, "": False}.get(compile, compile)
    if not compile or stage.device.type != "cuda" or not stage.fuse():
        return None
    return "default" if compile is True else compile


def compiled(fn: Callable, mode: str) -> Callable:
    """`fn` compiled whole (no graph breaks) for fixed shapes but the attention span."""
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 64))  # one per token count
    return torch.compile(fn, fullgraph=True, dynamic=False, mode=mode)


@contextmanager
def scratch_tail(stage: Stage, n: int) -> Iterator[None]:
    """Warm-up and capture run the pass for real on the last n cache slots: keep what they held."""
    caches = [*stage.k_caches, *stage.v_caches]
    saved = [c[:, :, -n:].clone() for c in caches]
    try:
        yield
    finally:
        for c, s in zip(caches, saved):
            c[:, :, -n:].copy_(s)


def capture(fn: Callable, pool, device: torch.device) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm `fn` up (compiling it if it is compiled) on a side stream of `device`, then capture it; returns
    (graph, output). Replays must run with `device` current too."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # a stream of `device`: torch's default capture stream belongs to whichever device captured first
        with torch.cuda.graph(graph, pool=pool, stream=torch.cuda.Stream(device)):
            out = fn()
    return graph, out


class DeviceClock:
    """CUDA events around one piece of device work: the device's own time for it, without the host's
    share (launches, copies waited on, the sync). Read `ms()` after the caller's sync; None off CUDA and
    for work spread over several devices (device None), which one device's stream cannot time."""

    def __init__(self, device: torch.device | None):
        self.device = device
        self.on = device is not None and device.type == "cuda"  # whether ms() can ever give a time
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.on else None
        self.timed = False  # both marks made since the last reset

    def reset(self) -> None:
        """A call that did no device work: ms() says None, not the time of an earlier call."""
        self.timed = False

    def mark(self, i: int) -> None:
        if self.events:
            self.events[i].record(torch.cuda.current_stream(self.device))
            self.timed = i == 1

    def ms(self) -> float | None:
        return self.events[0].elapsed_time(self.events[1]) if self.events and self.timed else None


def larger_captured(captured: dict, n: int, start: int, max_len: int) -> tuple[int, int] | None:
    """The smallest captured (size, span) that can run n tokens at `start` by padding: a round shortened
    near the end of an answer replays an existing graph instead of compiling a new one."""
    fits = [(m, S) for m, S in captured if m >= n and start + m <= max_len and S == span(start + m, max_len)]
    return min(fits, default=None)


def padded(T: int) -> int:
    """Token counts are rounded up to 2^k + 1 (K + 1 for K = 0, 1, 2, 4, 8, ...), so a round shortened
    near the end of an answer reuses a captured (and compiled) graph instead of making a new one."""
    return 1 if T <= 1 else (1 << (T - 2).bit_length()) + 1


def pad(x: torch.Tensor, P: int, ids: bool) -> torch.Tensor:
    T = x.shape[0] if ids else x.shape[1]
    if P == T:
        return x
    return torch.cat([x, x.new_zeros(P - T)]) if ids else torch.cat([x, x.new_zeros(1, P - T, x.shape[2])], 1)


class StageRunner:
    """Run `stage` on T new tokens at `start`: rewinds the cache to start, leaves it at start + T."""

    def __init__(self, stage: Stage, graphs: bool | None = None, compile: bool | str | None = None):
        self.stage = stage
        self.device = stage.device
        one_device = len({layer.input_layernorm.weight.device for layer in stage.layers}) == 1
        self.graphs = (self.device.type == "cuda" and one_device) if graphs is None else graphs
        self.compile = compile_mode(stage, compile) if self.graphs else None
        self._pass_fn = compiled(self._pass, self.compile) if self.compile else self._pass
        # (T, span) -> (graph, x, start, out, slots): every tensor a graph reads must stay referenced, or
        # its memory goes back to the allocator and later replays read whatever was put there
        self._captured: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor,
                                                     torch.Tensor]] = {}
        self._pool = None
        self.clock = DeviceClock(self.device if one_device else None)  # the last call's device time

    def __call__(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x: token ids [T] (first stage) or hidden [1, T, D], on the stage's device or the host (one copy
        into the graph's input then). Returns the stage output for the T tokens, on the device."""
        stage = self.stage
        T = x.shape[0] if stage.first else x.shape[1]
        stage.rewind(start)
        if not self.graphs:
            self.clock.mark(0)
            out = stage.step(x.to(self.device))
            self.clock.mark(1)
            return out
        if start + T > stage.max_len:
            raise ValueError(f"KV cache full: {start} + {T} tokens > {stage.max_len} slots")
        key = larger_captured(self._captured, T, start, stage.max_len)
        if key is None:
            P = padded(T) if start + padded(T) <= stage.max_len else T
            key = (P, span(start + P, stage.max_len))
            self._capture(*key, pad(x.to(self.device), P, stage.first))
        P = key[0]
        graph, x_in, start_in, out, _ = self._captured[key]
        self.clock.mark(0)
        if stage.first:
            x_in[:T].copy_(x, non_blocking=True)
        else:
            x_in[:, :T].copy_(x, non_blocking=True)
        start_in.fill_(start)
        with torch.cuda.device(self.device):  # replays go to the current device's stream
            graph.replay()
        self.clock.mark(1)
        stage.length = start + T  # the padding's cache slots lie past the valid length
        return out if P == T else out[:, :T]

    def _pass(self, x: torch.Tensor, start: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        pos = start + torch.arange(x.shape[0] if self.stage.first else x.shape[1], device=self.device)
        return self.stage(x, pos, pos, slots[None, :] <= pos[:, None])

    def _capture(self, T: int, S: int, example: torch.Tensor) -> None:
        stage = self.stage
        x_in = torch.zeros_like(example)
        start_in = torch.full((1,), stage.max_len - T, dtype=torch.long, device=self.device)
        slots = torch.arange(S, device=self.device)
        torch._dynamo.maybe_mark_dynamic(slots, 0)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with scratch_tail(stage, T):
            graph, out = capture(lambda: self._pass_fn(x_in, start_in, slots), self._pool, self.device)
        self._captured[T, S] = (graph, x_in, start_in, out, slots)
