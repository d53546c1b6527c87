"""Keep a node's GPU clocked up for the frame it is waiting for.

Between two rounds a GPU idles for a whole WAN round trip and lowers its clocks, so the first kernels
after a verdict (the draft) or after a stage's input run slower than the same kernels back to back
(bench/NOTES.md: ~0.5 ms of a 98 ms round on an H200). A node knows roughly when its next frame comes:
the last few rounds took about the same time. From `lead_ms` before that moment until the frame is
there, a one-thread spin kernel runs on a side stream, which keeps the GPU busy (and its clocks up)
while taking one warp slot of one SM from the real work. Clock settings are left alone.
"""
from __future__ import annotations

import collections
import statistics
import time

import torch

SPIN_S = 0.001  # one spin kernel's length at SPIN_HZ
SPIN_HZ = 2.0e9  # cycles per second assumed when sizing it (about the boost clock of current GPUs)
LATE_S = 0.010  # a frame this late past its expected time lets the GPU idle again


class Warmer:
    """Learns how long a node waits for its next frame, and spins the GPU for the last `lead_ms` of it."""

    def __init__(self, devices: list[torch.device], lead_ms: float, window: int = 5):
        gpus = sorted({d for d in devices if d.type == "cuda"}, key=str)
        self.on = bool(gpus) and lead_ms > 0
        self.lead = lead_ms / 1000
        self.waits: collections.deque[float] = collections.deque(maxlen=window)
        self.due: float | None = None
        self.next_spin = 0.0
        self.spins = 0  # spin kernels launched (a test's and a benchmark's check that it runs)
        # per GPU: a side stream and the ends of its last two spins
        self.gpus = [(torch.cuda.Stream(d), collections.deque(maxlen=2)) for d in gpus] if self.on else []

    def waited(self, seconds: float) -> None:
        """One wait's length, from the event the frame answers (a send, the previous frame) to its arrival."""
        if 0 < seconds < 1.0:  # longer: a new prompt or a fault, not the rhythm of rounds
            self.waits.append(seconds)

    def expect(self, since: float) -> None:
        """The frame now awaited answers an event at `since` (perf_counter seconds)."""
        self.due = since + statistics.median(self.waits) if self.on and self.waits else None
        self.next_spin = 0.0 if self.due is None else self.due - self.lead

    def arrived(self) -> None:
        self.due = None

    def timeout(self, limit: float) -> float:
        """How long the caller's wait may block before `poke` must run again (at most `limit`)."""
        if self.due is None:
            return limit
        now = time.perf_counter()
        if now > self.due + LATE_S:
            return limit
        return max(0.0, min(limit, self.next_spin - now))

    def poke(self) -> None:
        """Queue the next spin if the frame is within `lead_ms` (or a little late), keeping one spin queued
        behind the running one (a slow clock makes a spin last longer than SPIN_S: no pile-up then)."""
        if self.due is None:
            return
        now = time.perf_counter()
        if now < self.next_spin or now > self.due + LATE_S:
            return
        self.next_spin = now + SPIN_S / 2
        for stream, queued in self.gpus:
            if len(queued) == 2 and not queued[0].query():
                continue
            with torch.cuda.stream(stream):
                torch.cuda._sleep(int(SPIN_S * SPIN_HZ))
                end = torch.cuda.Event()
                end.record()
            queued.append(end)
            self.spins += 1
