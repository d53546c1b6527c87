"""Load: 100 sessions of 2-3 stages push frames of 1 KB-1 MB around their rings through one relay process.

Every frame carries its session and sequence number; each stage checks what it gets, so a frame lost,
duplicated, reordered or delivered to the wrong session fails the test. The relay's RSS is sampled throughout.
"""
from __future__ import annotations

import collections
import math
import os
import random
import struct
import threading
import time

import pytest
from relay_helpers import RelayProcess

from kit.client import RelayClient
from relay.protocol import FrameType, decode_control, encode_control, session_id

SESSIONS = 100
TRAFFIC_SECONDS = 10.0
WINDOW = 2  # frames in flight per session
TAG = struct.Struct("<QQQ")  # session index, sequence number, payload size
RSS_LIMIT_MB = 200  # the systemd unit caps the relay at 256 MB
FILLER = os.urandom(1 << 20)


def frame_size(rng: random.Random) -> int:
    return int(math.exp(rng.uniform(math.log(1024), math.log(1 << 20))))  # log-uniform 1 KiB..1 MiB


class Ring:
    """One session: stage 0 drives numbered frames round the ring, the other stages check and pass them on."""

    def __init__(self, relay: RelayProcess, index: int, stages: int):
        self.index, self.stages = index, stages
        self.name = f"load-{index}"
        self.clients = [RelayClient(relay.address, self.name, s, stages, relay.token, connect_timeout=30)
                        for s in range(stages)]
        self.sent = self.returned = self.forwarded = 0
        self.errors: list = []
        self.threads = [threading.Thread(target=self._guard, args=(self._drive,), daemon=True)]
        self.threads += [threading.Thread(target=self._guard, args=(self._forward, s), daemon=True)
                         for s in range(1, stages)]

    def start(self, until: float) -> None:
        self.until = until
        for c in self.clients:
            c.connect()
        for t in self.threads:
            t.start()

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as e:  # collected and asserted by the test
            self.errors.append(f"{self.name}: {e!r}")

    def _check(self, f, stage: int, expected_seq: int) -> int:
        idx, seq, size = TAG.unpack_from(f.payload)
        prev = (stage - 1) % self.stages
        assert f.type == FrameType.TENSOR, f"stage {stage} got {f.type.name}"
        assert f.session == session_id(self.name) and idx == self.index, f"stage {stage} got session {idx}'s frame"
        assert f.src == prev and f.dst == stage, f"stage {stage} got a frame from {f.src} to {f.dst}"
        assert seq == expected_seq == f.round_id, f"stage {stage} expected #{expected_seq}, got #{seq}"
        assert len(f.payload) == size, "frame truncated"
        return seq

    def _drive(self) -> None:
        rng = random.Random(self.index)
        c0, inflight = self.clients[0], collections.deque()
        while time.monotonic() < self.until or inflight:
            while len(inflight) < WINDOW and time.monotonic() < self.until:
                size = frame_size(rng)
                payload = TAG.pack(self.index, self.sent, size) + FILLER[:size - TAG.size]
                c0.send(1 % self.stages, FrameType.TENSOR, payload, round_id=self.sent)
                inflight.append(self.sent)
                self.sent += 1
            f = c0.recv(timeout=30)
            assert f is not None, "stage 0 waited 30 s for a frame"
            self._check(f, 0, inflight.popleft())
            assert f.payload[TAG.size:] == FILLER[:len(f.payload) - TAG.size], "payload corrupted"
            self.returned += 1
        for s in range(1, self.stages):
            c0.send(s, FrameType.CONTROL, encode_control({"stop": self.sent}))

    def _forward(self, stage: int) -> None:
        client, expected = self.clients[stage], 0
        while True:
            f = client.recv(timeout=30)
            assert f is not None, f"stage {stage} waited 30 s for a frame"
            if f.type == FrameType.CONTROL:
                assert decode_control(f.payload) == {"stop": expected}, "stage saw a different number of frames"
                return
            expected = self._check(f, stage, expected) + 1
            client.send((stage + 1) % self.stages, FrameType.TENSOR, f.payload, round_id=f.round_id)
            self.forwarded += 1

    def close(self) -> None:
        for t in self.threads:
            t.join(60)
        for c in self.clients:
            c.close()


@pytest.mark.timeout(180)
def test_hundred_sessions_lose_nothing_and_memory_stays_bounded(tmp_path):
    relay = RelayProcess(tmp_path, "--auth-failures", "0", "--max-pending-per-addr", "1000")
    rings = [Ring(relay, i, 2 + i % 2) for i in range(SESSIONS)]
    peak_rss, sampling = [relay.rss_kb()], threading.Event()

    def sample() -> None:
        while not sampling.wait(0.2):
            peak_rss.append(relay.rss_kb())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        until = time.monotonic() + TRAFFIC_SECONDS
        starters = [threading.Thread(target=r.start, args=(until,)) for r in rings]
        for t in starters:
            t.start()
        for t in starters:
            t.join(60)
        for r in rings:
            r.close()
        sampling.set()
        sampler.join()
        errors = [e for r in rings for e in r.errors]
        assert not errors, errors[:5]
        for r in rings:
            assert r.sent == r.returned > 0, f"{r.name}: sent {r.sent}, returned {r.returned}"
            assert r.forwarded == r.sent * (r.stages - 1)
            assert all(c.reconnects == 0 for c in r.clients)
        m = relay.metrics()
        total = sum(r.sent for r in rings)
        assert m["kit_relay_stage_unavailable_total"] == 0 and m["kit_relay_replaced_total"] == 0
        assert m['kit_relay_frames_total{direction="out"}'] >= sum(r.sent * r.stages for r in rings)
        mb = m['kit_relay_bytes_total{direction="out"}'] / 1e6
        print(f"\n{total} frames, {mb:.0f} MB through the relay in {TRAFFIC_SECONDS:g} s; "
              f"relay RSS peak {max(peak_rss) / 1024:.0f} MB (start {peak_rss[0] / 1024:.0f} MB)")
        assert max(peak_rss) < RSS_LIMIT_MB * 1024
        log = relay.log()
        assert "event=close " not in log and "loop_error" not in log
    finally:
        sampling.set()
        relay.stop()
