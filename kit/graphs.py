"""Fixed-shape passes of a stage, captured as CUDA graphs per token count (eager on CPU).

A round always writes T tokens as a chain starting at some cache slot; only the inputs and the start
change, so the positions, slots and mask are computed on the device from one start tensor and the
whole pass replays without host work.
"""
from __future__ import annotations

import torch

from kit.model import Stage


class StageRunner:
    """Run `stage` on T new tokens at `start`: rewinds the cache to start, leaves it at start + T."""

    def __init__(self, stage: Stage, graphs: bool | None = None):
        self.stage = stage
        one_device = len({layer.input_layernorm.weight.device for layer in stage.layers}) == 1
        self.graphs = (stage.device.type == "cuda" and one_device) if graphs is None else graphs
        self._captured: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._pool = None

    def __call__(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x: token ids [T] (first stage) or hidden [1, T, D]. Returns the stage output for the T tokens."""
        stage = self.stage
        T = x.shape[0] if stage.first else x.shape[1]
        stage.rewind(start)
        if not self.graphs:
            return stage.step(x)
        if start + T > stage.max_len:
            raise ValueError(f"KV cache full: {start} + {T} tokens > {stage.max_len} slots")
        if T not in self._captured:
            self._capture(T, x)
        graph, x_in, start_in, out = self._captured[T]
        x_in.copy_(x, non_blocking=True)
        start_in.fill_(start)
        graph.replay()
        stage.length = start + T
        return out

    def _pass(self, x: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        dev = self.stage.device
        pos = start + torch.arange(x.shape[0] if self.stage.first else x.shape[1], device=dev)
        mask = torch.arange(self.stage.max_len, device=dev)[None, :] <= pos[:, None]
        return self.stage(x, pos, pos, mask)

    def _capture(self, T: int, example: torch.Tensor) -> None:
        stage = self.stage
        x_in = torch.zeros_like(example)
        # warm-up and capture write slots at the end of the cache, which hold nothing valid yet
        start_in = torch.full((1,), stage.max_len - T, dtype=torch.long, device=stage.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._pass(x_in, start_in)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._pass(x_in, start_in)
        self._captured[T] = (graph, x_in, start_in, out)
