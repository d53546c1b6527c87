"""One stage of the ring: node 0 drives rounds, middle stages forward hidden states, the last verifies.

Messages (all through the relay, see docs/PROTOCOL.md):
  TENSOR  i -> i+1   hidden states of positions start..start+T-1, meta {kind: prefill|round, gen, start,
                     tokens, rid, stage_ms, ...}; a round's tokens are [last committed, d1..dK].
  TOKENS  last -> 0  verdict: the committed tokens [d1..da, next], meta {rid, gen, accepted, stage_ms}.
  CONTROL            hello (a stage is up, with its boot id), who (node 0 asks), stale (a stage lacks the
                     prefix a round needs: it restarted), end (session over).

Every stage rewinds its cache to a frame's `start` before writing, so a resent or replayed frame is
idempotent. The last stage holds the frontier (start, first token) that the next valid round must have;
a round built on a guess that failed is discarded without compute. A stage whose cache is shorter than a
frame's start asks node 0 to replay the committed tokens.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kit.client import RelayClient
from kit.draft import check_same_tokenizer, make_drafter
from kit.generate import AdaptiveK, commit
from kit.graphs import StageRunner
from kit.load import CheckpointError, load_config, load_stage, parse_dtype, resolve
from kit.metrics import MetricsWriter, Progress
from kit.model import ConfigError, Stage
from kit.plan import (PlanError, check_fit, estimate_kv, estimate_weights, even_split, format_plan, layer_devices,
                      place_node)
from kit.verify import Sampling, verify
from relay.protocol import (Frame, FrameType, decode_control, decode_error, decode_tensor, decode_tokens,
                            encode_control, encode_tensor, encode_tokens)

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
PREFILL_CHUNK = 128
TOP = 3  # overlap: the drafter's likeliest tokens kept per draft, its top and two runner-ups


class StageTimeout(RuntimeError):
    """A stage stayed away longer than the allowed time."""


def to_payload(h: torch.Tensor, meta: dict) -> bytes:
    h = h.detach().contiguous()
    raw = h.view(torch.uint8).cpu().numpy() if h.numel() else b""
    return encode_tensor(meta, str(h.dtype).removeprefix("torch."), tuple(h.shape), raw)


def from_payload(payload: bytes) -> tuple[dict, torch.Tensor]:
    """The meta and the tensor, still on the host: a stage's runner copies it straight into its graph's input."""
    meta, dtype, shape, data = decode_tensor(payload)  # received payloads are writable: no copy on the host
    t = torch.frombuffer(data, dtype=TORCH_DTYPES[dtype]) if len(data) else torch.empty(0, dtype=TORCH_DTYPES[dtype])
    return meta, t.view(shape)


def memory_report() -> dict:
    """Peak memory of this process: per CUDA device, and host RSS."""
    import resource

    gpus = {f"cuda:{i}": torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())
            if torch.cuda.is_initialized()}
    return {"peak_gpu_bytes": gpus, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def draft_device_ms(drafter) -> float | None:
    """The drafter's device time for its last drafts (CUDA events); None for lookup drafters and off CUDA."""
    clock = getattr(drafter, "clock", None)
    return clock.ms() if clock else None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StageServer:
    """Stages 1..N-1: serve frames until node 0 ends the session."""

    def __init__(self, client: RelayClient, stage: Stage, *, graphs: bool | None = None, log=sys.stderr):
        self.client, self.stage, self.log = client, stage, log
        self.runner = StageRunner(stage, graphs)
        self.index, self.n = client.stage, client.stages
        self.last = self.index == self.n - 1
        self.boot = uuid.uuid4().hex[:12]
        self.frontier: tuple[int, int] | None = None  # (start, first token) of the next valid round
        self.sampling = Sampling()
        self.gen = -1
        self.verdicts: collections.OrderedDict[tuple[int, int], tuple[list[int], dict]] = collections.OrderedDict()
        # when the last TENSOR frame came (perf_counter) and recent gaps between them, s: the next is due
        # at the shortest gap after the last
        self.arrived: float | None = None
        self.gaps: collections.deque[float] = collections.deque(maxlen=8)

    def hello(self) -> None:
        self.client.send(0, FrameType.CONTROL, encode_control({"op": "hello", "stage": self.index, "boot": self.boot}))

    def serve(self, idle_timeout: float | None = None) -> bool:
        """Serve until node 0 ends the session (True) or nothing comes for idle_timeout seconds (False)."""
        self.hello()
        heard = time.monotonic()
        while True:
            f = self.client.recv(timeout=1.0, due=self.arrived + min(self.gaps) if self.gaps else None)
            if f is None:
                if idle_timeout and time.monotonic() - heard > idle_timeout:
                    return False
                continue
            heard = time.monotonic()
            if f.type == FrameType.CONTROL:
                msg = decode_control(f.payload)
                if msg.get("op") == "who":
                    self.hello()
                elif msg.get("op") == "end":
                    self.client.send(0, FrameType.CONTROL, encode_control(
                        {"op": "bye", "stage": self.index, **memory_report()}))
                    return True
            elif f.type == FrameType.TENSOR:
                if f.received:
                    if self.arrived is not None:
                        self.gaps.append(f.received - self.arrived)
                    self.arrived = f.received
                self.on_tensor(f)
            elif f.type == FrameType.ERROR:
                print(f"[stage {self.index}] relay: {decode_error(f.payload).get('message')}", file=self.log)
            elif f.type == FrameType.BYE:
                continue

    def on_tensor(self, frame: Frame) -> None:
        dev = self.stage.device
        meta, h = from_payload(frame.payload)
        start, T = meta["start"], h.shape[1]
        if meta["gen"] < self.gen:
            return  # a frame of a generation node 0 has already replaced
        if start > self.stage.length:
            self.client.send(0, FrameType.CONTROL, encode_control(
                {"op": "stale", "stage": self.index, "have": self.stage.length, "gen": meta["gen"]}))
            return
        self.gen = meta["gen"]
        t0 = time.perf_counter()
        # from the frame's last byte off the socket to compute: reader -> main thread wake-up, unpacking
        meta["host_ms"] = meta.get("host_ms", []) + [(t0 - frame.received) * 1000 if frame.received else 0.0]
        if meta["kind"] == "prefill":
            self.stage.rewind(start)
            out = self.stage.step(h.to(dev), head=False) if T else h.to(dev)
            if meta.get("final") and self.last:
                self.frontier = (meta["end"], meta["next"])
                self.sampling = Sampling(**meta["sampling"])
                self.verdicts.clear()
            sync(dev)
            if not self.last:
                self.forward(meta, out, t0)
            return
        if not self.last:
            out = self.runner(h, start)
            sync(dev)
            self.forward(dict(meta, stage_gpu_ms=meta.get("stage_gpu_ms", []) + [self.runner.clock.ms()]), out, t0)
            return
        key = (meta["gen"], meta["rid"])
        if key in self.verdicts:  # a resend: answer again, compute nothing
            ids, vmeta = self.verdicts[key]
            self.client.send(0, FrameType.TOKENS, encode_tokens(ids, vmeta), round_id=meta["rid"])
            return
        tokens = meta["tokens"]
        if self.frontier != (start, tokens[0]):
            vmeta = {"rid": meta["rid"], "gen": meta["gen"], "discarded": True}
            self.client.send(0, FrameType.TOKENS, encode_tokens([], vmeta), round_id=meta["rid"])
            return
        logits = self.runner(h, start)[0]
        accepted, nxt = verify(logits, tokens[1:], self.sampling, start + 1)
        self.frontier = (start + accepted + 1, nxt)
        ms = (time.perf_counter() - t0) * 1000
        ids = tokens[1:1 + accepted] + [nxt]
        vmeta = {"rid": meta["rid"], "gen": meta["gen"], "accepted": accepted, "start": start,
                 "stage_ms": meta.get("stage_ms", []) + [ms], "host_ms": meta["host_ms"],
                 "stage_gpu_ms": meta.get("stage_gpu_ms", []) + [self.runner.clock.ms()]}
        self.verdicts[key] = (ids, vmeta)
        while len(self.verdicts) > 64:
            self.verdicts.popitem(last=False)
        self.client.send(0, FrameType.TOKENS, encode_tokens(ids, vmeta), round_id=meta["rid"])

    def forward(self, meta: dict, out: torch.Tensor, t0: float) -> None:
        meta = dict(meta, stage_ms=meta.get("stage_ms", []) + [(time.perf_counter() - t0) * 1000])
        self.client.send(self.index + 1, FrameType.TENSOR, to_payload(out, meta), round_id=meta.get("rid", 0))


@dataclass
class Flight:
    """A round sent and not yet answered."""

    rid: int
    base: list[int]  # the context it builds on (committed, or assumed after earlier rounds in flight)
    drafts: list[int]
    began: float  # perf_counter when its drafting began
    draft_ms: float
    draft_gpu_ms: float | None  # the drafter's device time (CUDA events), None without a model drafter on CUDA
    stage0_ms: float
    send_ms: float  # stage 0's output packed and handed to the socket
    payload: bytes
    predrafted: bool  # its drafts were made while the round before it was on the wire (overlap)
    sent: float = 0.0  # perf_counter once it was handed to the socket
    top: tuple = ([], [])  # the drafter's likeliest tokens and log-probabilities at each draft (ModelDrafter.top)
    guess: int | None = None  # the drafter's guess of the token after the drafts if all are accepted
    branches: int = 0  # runner-up branches drafted while it was out
    ahead_ms: float = 0.0  # node 0's wall time drafting ahead (guess and branches) while it was out

    @property
    def start(self) -> int:
        return len(self.base) - 1

    @property
    def assumed(self) -> list[int]:
        return self.base + self.drafts


@dataclass
class RunOptions:
    max_new_tokens: int = 128
    k: int = 4
    adaptive: bool = False
    depth: int = 1  # rounds in flight
    overlap: bool = True
    branches: int = 8  # overlap: runner-up branches drafted at most while a round is out
    sampling: Sampling = field(default_factory=Sampling)
    resend_after_s: float = 3.0
    stage_timeout_s: float = 60.0


class Replay(Exception):
    """A stage lost its cache: rebuild every stage from the committed tokens."""


class Driver:
    """Node 0: prefill, then rounds of draft -> stage 0 -> ring -> verdict, with overlap and rounds in flight."""

    def __init__(self, client: RelayClient, stage: Stage, drafter, *, graphs: bool | None = None,
                 metrics: MetricsWriter | None = None, progress: Progress | None = None, log=sys.stderr,
                 on_tokens=None):
        self.client, self.stage, self.drafter = client, stage, drafter
        self.runner = StageRunner(stage, graphs)
        self.n = client.stages
        self.metrics, self.progress, self.log, self.on_tokens = metrics, progress, log, on_tokens
        self.boots: dict[int, str] = {}
        self.gen = time.time_ns() // 1_000_000  # grows across restarts of node 0, so stages follow a new one
        self.rid = 0
        self.last_reconnects = client.reconnects
        # overlap: drafts made while a round was out, by the context they continue -> (drafts, their top)
        self.predrafts: dict[tuple[int, ...], tuple[list[int], tuple]] = {}
        self.trips: collections.deque[float] = collections.deque(maxlen=16)  # send -> verdict, ms
        # wall time of recent predrafts (full-acceptance guesses and branches): a median ignores the rare
        # one that captured a graph
        self.predraft_ms: collections.deque[float] = collections.deque(maxlen=9)
        self.partial: list[int] = []
        self.prompt_index = -1

    def send_all(self, msg: dict) -> None:
        for i in range(1, self.n):
            self.client.send(i, FrameType.CONTROL, encode_control(msg))

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Block until every other stage has said hello (they may still be loading weights)."""
        deadline = time.monotonic() + timeout
        asked = 0.0
        while len(self.boots) < self.n - 1:
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, self.n)) - set(self.boots))
                raise StageTimeout(f"stages {missing} did not come up within {timeout:.0f} s")
            if time.monotonic() - asked > 2.0:
                self.send_all({"op": "who"})
                asked = time.monotonic()
            f = self.client.recv(timeout=0.5)
            if f is not None and f.type == FrameType.CONTROL:
                msg = decode_control(f.payload)
                if msg.get("op") == "hello":
                    self.boots[msg["stage"]] = msg["boot"]

    def ping_stages(self, count: int = 8, gap_s: float = 0.05) -> dict[str, float]:
        """Median PING round trip to each other stage through the relay, paced like rounds (a process
        that idled between frames wakes up slower): what the network path costs without any compute."""
        times: dict[str, list[float]] = {str(i): [] for i in range(1, self.n)}
        silent: set[int] = set()  # a stage that missed one PING is not asked again: the run goes on without it
        for _ in range(count):
            for i in sorted(set(range(1, self.n)) - silent):
                try:
                    times[str(i)].append(self.client.ping(timeout=5.0, dst=i))
                except TimeoutError:
                    silent.add(i)
                time.sleep(gap_s)
        return {i: statistics.median(t) for i, t in times.items() if t}

    def end(self, wait_s: float = 3.0) -> dict[int, dict]:
        """End the session; returns each stage's memory report (stage 0's too)."""
        self.send_all({"op": "end"})
        reports = {0: memory_report()}
        deadline = time.monotonic() + wait_s
        while len(reports) < self.n and time.monotonic() < deadline:
            f = self.client.recv(timeout=0.2)
            if f is not None and f.type == FrameType.CONTROL:
                msg = decode_control(f.payload)
                if msg.get("op") == "bye":
                    reports[msg["stage"]] = {k: msg[k] for k in ("peak_gpu_bytes", "peak_rss_bytes")}
        return reports

    # -- generation -------------------------------------------------------------------------------------
    def generate(self, prompt: list[int], opts: RunOptions, eos_ids: set[int], stop=None) -> dict:
        if not prompt:
            raise ValueError("the prompt is empty")
        t0 = time.perf_counter()
        adaptive = AdaptiveK(k_min=1, k_max=max(1, opts.k)) if opts.adaptive else None
        context, out = list(prompt), []
        self.prompt_index += 1
        if self.metrics:
            self.metrics.start_prompt()
        if self.progress:
            self.progress.start()
        self.partial = out  # what an interrupted run saves
        first_token_at, rounds, replays, reason = None, 0, 0, None
        progress_at = time.monotonic()
        self.prefill(context, opts.sampling)
        flights: collections.deque[Flight] = collections.deque()
        done = None  # the last verdict's bookkeeping, done once the next round is on the wire
        try:
            while reason is None:
                try:
                    self.fill(flights, context, out, opts, adaptive)
                    if done:
                        self.report(*done)
                        done = None
                    if not flights:
                        reason = "length"
                        break
                    if opts.overlap and opts.depth == 1 and opts.branches:
                        self.draft_branches(flights[0], opts)
                    ids, vmeta = self.wait_verdict(flights, opts, progress_at)
                except Replay:
                    replays += 1
                    flights.clear()
                    self.prefill(context, opts.sampling)
                    progress_at = time.monotonic()
                    continue
                progress_at = time.monotonic()
                f = flights.popleft()
                accepted = vmeta["accepted"]
                before = len(out)
                reason = commit(out, ids, opts.max_new_tokens, eos_ids, stop)
                new = out[before:]
                context[len(prompt):] = out
                now = time.perf_counter()
                first_token_at = first_token_at or now
                rounds += 1
                if adaptive:
                    adaptive.update(len(f.drafts), accepted)
                    adaptive.measure((now - f.began) * 1000 - f.draft_ms, f.draft_ms, len(f.drafts))
                full = accepted == len(f.drafts) and reason is None
                if flights and not (full and flights[0].base[-1] == ids[-1]):
                    flights.clear()  # built on a guess that failed; the last stage discards them too
                done = (f, vmeta, new, now, t0, out)
                if len(context) >= self.stage.max_len and reason is None:
                    reason = "length"
        finally:  # also when a stage times out: the last verdict is still shown and written
            if done:
                self.report(*done)
        end = time.perf_counter()
        first_token_at = first_token_at or end
        after = end - first_token_at
        return {"token_ids": out, "prompt_tokens": len(prompt), "generated_tokens": len(out),
                "rounds": rounds, "tokens_per_round": len(out) / max(1, rounds),
                "tps": (len(out) - 1) / after if len(out) > 1 and after > 0 else 0.0,
                "ttft_ms": (first_token_at - t0) * 1000, "finish_reason": reason, "seconds": end - t0,
                "replays": replays}

    def prefill(self, context: list[int], sampling: Sampling) -> None:
        """Send context[:-1] down the ring in chunks (stage 1 computes a chunk while the next is on the
        wire); the final chunk sets the last stage's frontier and sampling."""
        self.gen += 1
        self.predrafts = {}
        ids = context[:-1]
        dev = self.stage.device
        starts = list(range(0, len(ids), PREFILL_CHUNK)) or [0]
        for s in starts:
            chunk = ids[s:s + PREFILL_CHUNK]
            self.stage.rewind(s)
            if chunk:
                h = self.stage.step(torch.tensor(chunk, device=dev), head=False)
            else:
                h = torch.zeros(1, 0, self.stage.cfg.hidden_size, dtype=self.stage.dtype, device=dev)
            meta = {"kind": "prefill", "gen": self.gen, "start": s, "end": len(ids)}
            if s == starts[-1]:
                meta.update(final=True, next=context[-1], sampling=dataclasses.asdict(sampling))
            self.client.send(1, FrameType.TENSOR, to_payload(h, meta))

    def fill(self, flights, context, out, opts: RunOptions, adaptive) -> None:
        """Send rounds until `depth` are in flight (or the assumed output already reaches max_new_tokens)."""
        while len(flights) < opts.depth:
            in_flight = sum(len(f.drafts) + 1 for f in flights)
            room = opts.max_new_tokens - len(out) - in_flight
            if room <= 0:
                return
            want = adaptive.choose() if adaptive else opts.k
            t0 = time.perf_counter()
            predrafted, gpu_ms, top = False, None, None
            if not flights:
                base = list(context)
                hit = self.predrafts.get(tuple(base))
                predrafted = hit is not None
                if predrafted:
                    drafts, top = hit  # drafted while the previous round was on the wire
                    clock = getattr(self.drafter, "clock", None)
                    gpu_ms = 0.0 if clock and clock.on else None  # no device work in this round
                else:
                    drafts = self.drafter.propose(base, self.clamp(want, base, room))
                    gpu_ms = draft_device_ms(self.drafter)
            else:
                prev = flights[-1]
                props = self.drafter.propose(prev.assumed, self.clamp(want, prev.assumed, room) + 1)
                if not props:
                    return  # nothing to guess the next token with: wait for the verdict
                base, drafts = prev.assumed + props[:1], props[1:]
                gpu_ms = draft_device_ms(self.drafter)
            self.predrafts = {}
            drafts = drafts[: self.clamp(want, base, room)]
            self.send_round(flights, base, drafts, t0, gpu_ms, opts, predrafted, top)

    def clamp(self, want: int, base: list[int], room: int) -> int:
        return max(0, min(want, room - 1, self.stage.max_len - len(base)))

    def send_round(self, flights, base, drafts, began: float, draft_gpu_ms: float | None, opts: RunOptions,
                   predrafted: bool, top: tuple | None = None) -> None:
        self.rid += 1
        tokens = [base[-1], *drafts]
        t0 = time.perf_counter()
        h = self.runner(torch.tensor(tokens), len(base) - 1)
        sync(self.stage.device)
        t1 = time.perf_counter()
        meta = {"kind": "round", "gen": self.gen, "rid": self.rid, "start": len(base) - 1, "tokens": tokens,
                "stage_ms": [(t1 - t0) * 1000], "stage_gpu_ms": [self.runner.clock.ms()]}
        payload = to_payload(h, meta)
        self.client.send(1, FrameType.TENSOR, payload, round_id=self.rid)
        sent = time.perf_counter()
        f = Flight(self.rid, base, drafts, began, (t0 - began) * 1000, draft_gpu_ms, (t1 - t0) * 1000,
                   (sent - t1) * 1000, payload, predrafted, sent)
        flights.append(f)
        if opts.overlap and opts.depth == 1:
            branching = opts.branches and hasattr(self.drafter, "top")
            if branching:
                f.top = top if top is not None else self.drafter.top(TOP)
            # draft the next round while this one is on the wire, assuming it is fully accepted
            spec = self.drafter.propose(f.assumed, self.clamp(opts.k, f.assumed, 1 << 30) + 1)
            if spec:
                f.guess = spec[0]
                spec_top = self.drafter.top(TOP) if branching else ([], [])
                self.predrafts[tuple(f.assumed + spec[:1])] = (spec[1:], (spec_top[0][1:], spec_top[1][1:]))
                # where a full acceptance's next token is not the drafter's guess, its runner-up may be
                f.top = (f.top[0][: len(drafts)] + spec_top[0][:1], f.top[1][: len(drafts)] + spec_top[1][:1])
                self.predraft_ms.append((time.perf_counter() - sent) * 1000)
            f.ahead_ms = (time.perf_counter() - sent) * 1000

    def draft_branches(self, f: Flight, opts: RunOptions) -> None:
        """While round f is out, draft the next round after the likeliest rejections: draft i rejected
        and the target's token there one of the drafter's runner-ups, ranked by the drafter's own
        probabilities. Only as many as fit before the verdict is due (the quickest recent round trip),
        and none once a frame is waiting: a miss costs the round nothing, a hit saves its drafting."""
        if not self.trips or not self.predraft_ms or f.guess is None:
            return
        cost = statistics.median(self.predraft_ms)
        due = f.sent + (min(self.trips) - 2 * cost) / 1000  # the last branch ends a cost before the verdict
        fit = int((due - time.perf_counter()) * 1000 / cost)
        chosen = rank_branches(f.drafts + [f.guess], f.top, min(fit, opts.branches))
        if not chosen:
            return
        began = time.perf_counter()
        # past the base the main line holds the drafts, the guess and its drafts (2K slots, with a spare few);
        # every branch writes inside them
        with self.drafter.aside(len(f.base), 2 * len(f.drafts) + 3):
            for a, t in sorted(chosen, key=lambda c: -c[0]):  # deepest first: each feeds the drafter one token
                if self.client.pending() or time.perf_counter() > due:
                    break
                t0 = time.perf_counter()
                ctx = f.assumed[: len(f.base) + a] + [t]
                drafts = self.drafter.propose(ctx, self.clamp(opts.k, ctx, 1 << 30))
                if drafts:
                    self.predrafts[tuple(ctx)] = (drafts, self.drafter.top(TOP))
                    f.branches += 1
                self.predraft_ms.append((time.perf_counter() - t0) * 1000)
        f.ahead_ms += (time.perf_counter() - began) * 1000

    def resend(self, flights) -> None:
        for f in flights:
            self.client.send(1, FrameType.TENSOR, f.payload, round_id=f.rid)

    def wait_verdict(self, flights, opts: RunOptions, progress_at: float) -> tuple[list[int], dict]:
        head = flights[0]
        resend_at = time.monotonic() + opts.resend_after_s
        while True:
            if self.client.reconnects != self.last_reconnects:
                self.last_reconnects = self.client.reconnects
                self.resend(flights)  # frames inside a broken link may be lost
                resend_at = time.monotonic() + opts.resend_after_s
            f = self.client.recv(timeout=0.25, due=head.sent + min(self.trips) / 1000 if self.trips else None)
            now = time.monotonic()
            if f is None:
                if now - progress_at > opts.stage_timeout_s:
                    raise StageTimeout(f"no verdict for {opts.stage_timeout_s:.0f} s: a stage is gone "
                                       f"(last heard: {sorted(self.boots)})")
                if now > resend_at:
                    self.resend(flights)
                    resend_at = now + opts.resend_after_s
                continue
            if f.type == FrameType.TOKENS:
                ids, vmeta = decode_tokens(f.payload)
                if vmeta.get("gen") == self.gen and vmeta.get("rid") == head.rid and not vmeta.get("discarded"):
                    now = time.perf_counter()
                    vmeta["wake_ms"] = (now - f.received) * 1000 if f.received else 0.0
                    self.trips.append(((f.received or now) - head.sent) * 1000)
                    return ids, vmeta
            elif f.type == FrameType.CONTROL:
                msg = decode_control(f.payload)
                if msg.get("op") == "stale" and msg.get("gen", self.gen) >= self.gen:
                    print(f"[node 0] stage {msg['stage']} lost its cache; replaying {len(head.base)} tokens", file=self.log)
                    raise Replay()
                if msg.get("op") == "hello":
                    known = self.boots.get(msg["stage"])
                    self.boots[msg["stage"]] = msg["boot"]
                    if known is not None and known != msg["boot"]:
                        print(f"[node 0] stage {msg['stage']} restarted; replaying", file=self.log)
                        raise Replay()
            elif f.type == FrameType.ERROR:
                err = decode_error(f.payload)
                print(f"[node 0] relay: {err.get('message')}; resending", file=self.log)
                resend_at = min(resend_at, now + 0.5)

    def report(self, f: Flight, vmeta: dict, new: list[int], now: float, t0: float, out: list[int]) -> None:
        """A verdict's bookkeeping (text stream, metrics row, progress line), kept off the critical path."""
        if self.on_tokens:
            self.on_tokens(out)
        round_ms = (now - f.began) * 1000
        stage_ms = vmeta.get("stage_ms", [])
        row = {"round": f.rid, "prompt": self.prompt_index, "t": round(now - t0, 6), "k": len(f.drafts), "accepted": vmeta["accepted"],
               "committed": len(new), "draft_ms": f.draft_ms, "predrafted": f.predrafted,
               "branches": f.branches, "ahead_ms": f.ahead_ms, "stage_ms": stage_ms,
               "draft_gpu_ms": f.draft_gpu_ms, "stage_gpu_ms": vmeta.get("stage_gpu_ms", []),
               "network_ms": max(0.0, round_ms - f.draft_ms - sum(stage_ms)), "round_ms": round_ms,
               "send_ms": f.send_ms, "host_ms": vmeta.get("host_ms", []), "wake_ms": vmeta.get("wake_ms", 0.0),
               "bytes_out": len(f.payload), "bytes_in": 8 + 4 * (vmeta["accepted"] + 1)}
        if self.metrics:
            self.metrics.round(row)
        if self.progress:
            self.progress.update(row)


def rank_branches(path: list[int], top: tuple, n: int) -> list[tuple[int, int]]:
    """The n likeliest (a, t) by the drafter's own probabilities: drafts path[:a] accepted, then the target's
    token t (one of the drafter's runner-ups at path[a]) instead of path[a]. `path` is a round's drafts and
    the drafter's guess of the token after them; top[0][i], top[1][i] its likeliest tokens and their
    log-probabilities at path[i] (ModelDrafter.top)."""
    cands, reach = [], 0.0  # reach: the drafter's log-probability that path[:a] is all accepted
    for a, (ids, lps) in enumerate(zip(*top)):
        if a >= len(path):
            break
        cands += [(reach + lp, a, t) for t, lp in zip(ids, lps) if t != path[a]]
        reach += dict(zip(ids, lps)).get(path[a], -math.inf)
    return [(a, t) for _, a, t in sorted(cands, reverse=True)[: max(0, n)]]


# -- the `kit node` command ---------------------------------------------------------------------------------
def read_card(path: str | None) -> dict:
    """The relay card written by `python -m relay.provision` (relay, fingerprint, token)."""
    if not path:
        return {}
    try:
        card = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: cannot read relay card {path}: {e}")
    return card


def read_token(path: str | None, card: dict) -> str:
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as e:
            raise SystemExit(f"error: cannot read token file {path}: {e.strerror}")
    else:
        token = card.get("token", "")
    if not token:
        raise SystemExit("error: no session token: give --token-file or --relay-card")
    return token


def stage_layers(cfg, stage: int, stages: int, layers: str | None) -> tuple[int, int]:
    """This stage's layer range: --layers A:B, or an even split (middle stages take the remainder)."""
    if layers:
        a, _, b = layers.partition(":")
        try:
            start, end = int(a), int(b)
        except ValueError:
            raise SystemExit(f"error: --layers must be START:END, got {layers!r}")
        if not 0 <= start < end <= cfg.n_layers:
            raise SystemExit(f"error: layers {start}:{end} are outside the model's {cfg.n_layers} layers")
        return start, end
    if not 2 <= stages <= cfg.n_layers:
        raise SystemExit(f"error: --stages must be 2..{cfg.n_layers} for a {cfg.n_layers}-layer model")
    sizes = even_split(cfg.n_layers, stages)
    return sum(sizes[:stage]), sum(sizes[:stage + 1])


def place_layers(args, cfg, start: int, end: int, draft_cfg) -> tuple[list[str], str]:
    """A device per local layer and the drafter's device; on GPUs the plan checks that weights, KV and
    drafter fit, and says what to change when they do not."""
    devices = [d.strip() for d in args.device.split(",") if d.strip()]
    if devices[0] == "cpu":
        return ["cpu"] * (end - start), "cpu"
    if devices[0] == "cuda" and torch.cuda.device_count() > 1 and len(devices) == 1:
        devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    free = [torch.cuda.mem_get_info(torch.device(d))[1] for d in devices]  # each GPU's capacity
    dtype_bytes = torch.finfo(parse_dtype(args.dtype)).bits / 8
    draft = None
    if draft_cfg is not None:
        draft = (estimate_weights(draft_cfg, 0, draft_cfg.n_layers, True, True, dtype_bytes),
                 estimate_kv(draft_cfg, draft_cfg.n_layers, args.max_len, dtype_bytes))
    first, last = start == 0, end == cfg.n_layers
    if len(devices) > 1 and (draft is None or sum(draft) < min(free[1:])):
        # the whole stage on one GPU keeps its CUDA graphs (a stage spread over GPUs runs eagerly); a
        # model drafter then gets the next GPU to itself
        one = place_node(cfg, args.stage, start, end, first, last, gpus=1, gpu_bytes=free[0],
                         dtype_bytes=dtype_bytes, load_in_4bit=args.load_in_4bit, kv_len=args.max_len, draft=None)
        if all(m.total <= one.gpu_bytes for m in one.memory.values()):
            print(format_plan([one]), file=sys.stderr)
            if draft is not None:
                print(f"drafter on {devices[1]}", file=sys.stderr)
            return [devices[0]] * (end - start), devices[1] if draft is not None else devices[0]
    try:
        plan = place_node(cfg, args.stage, start, end, first, last, gpus=len(devices),
                          gpu_bytes=min(free), dtype_bytes=dtype_bytes, load_in_4bit=args.load_in_4bit,
                          kv_len=args.max_len, draft=draft)
        check_fit([plan], cfg, args.max_len, args.load_in_4bit, len(devices))
    except PlanError as e:
        raise SystemExit(f"error: {e}")
    names = {f"cuda:{i}": d for i, d in enumerate(devices)}
    print(format_plan([plan]), file=sys.stderr)
    return [names[d] for d in layer_devices(plan)], names.get(plan.draft_device or "cuda:0", devices[0])


def chat_ids(tokenizer, prompt: str, raw: bool) -> list[int]:
    if raw or not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode(prompt)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def eos_ids(folder: Path, cfg, tokenizer) -> set[int]:
    ids = set(cfg.eos_token_ids)
    gen = folder / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set([e] if isinstance(e, int) else e or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def stop_rule(tokenizer, stops: list[str]):
    """Cut after the token that completes the first stop string."""
    if not stops:
        return None

    def cut(ids: list[int]) -> int | None:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if not any(s in text for s in stops):
            return None
        for n in range(1, len(ids) + 1):
            if any(s in tokenizer.decode(ids[:n], skip_special_tokens=True) for s in stops):
                return n
        return None
    return cut


def prompts_of(args, tokenizer) -> list[list[int]]:
    if args.prompt_ids:
        try:
            return [[int(t) for t in ids.split(",")] for ids in args.prompt_ids]
        except ValueError:
            raise SystemExit("error: --prompt-ids must be comma-separated integers")
    texts = list(args.prompt or [])
    if args.prompts_file:
        texts += [line.strip() for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    if not texts:
        raise SystemExit("error: stage 0 needs --prompt, --prompt-ids or --prompts-file")
    return [chat_ids(tokenizer, t, args.raw) for t in texts]


def main(args) -> int:
    """`kit node`: load this stage, join the ring through the relay, serve (or drive, on stage 0)."""
    card = read_card(args.relay_card)
    relay = args.relay or card.get("relay")
    if not relay:
        raise SystemExit("error: no relay address: give --relay HOST:PORT or --relay-card")
    token = read_token(args.token_file, card)
    fingerprint = args.fingerprint or card.get("fingerprint")
    if not 0 <= args.stage < args.stages:
        raise SystemExit(f"error: --stage must be 0..{args.stages - 1}")
    try:
        folder = resolve(args.target)
        cfg = load_config(args.target)
        draft_cfg = None
        if args.stage == 0 and args.draft not in ("none", "ngram") and not args.draft.startswith("self:"):
            check_same_tokenizer(args.target, args.draft)  # before any weights load
            draft_cfg = load_config(args.draft)
        start, end = stage_layers(cfg, args.stage, args.stages, args.layers)
        devices, draft_device = place_layers(args, cfg, start, end, draft_cfg)
        if devices[0].startswith("cuda"):
            torch.cuda.set_device(torch.device(devices[0]))  # streams and graphs are made on the current device
        dtype = parse_dtype(args.dtype)
        stage = load_stage(args.target, start, end, first=args.stage == 0, last=args.stage == args.stages - 1,
                           dtype=dtype, layer_devices=devices, load_in_4bit=args.load_in_4bit, max_len=args.max_len)
    except (CheckpointError, ConfigError, PlanError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    client = RelayClient(relay, args.session, args.stage, args.stages, token, fingerprint,
                         reconnect_deadline=args.stage_timeout, spin_s=max(0.0, args.spin_ms) / 1000)
    try:
        client.connect()
    except Exception as e:
        raise SystemExit(f"error: cannot join the relay at {relay}: {e}")
    graphs = None if args.graphs == "auto" else args.graphs == "on"
    if args.stage != 0:
        print(f"[stage {args.stage}] layers {start}-{end - 1} ready; serving", file=sys.stderr)
        try:
            ended = StageServer(client, stage, graphs=graphs).serve(args.idle_timeout)
        finally:
            client.close()
        if not ended:
            print(f"[stage {args.stage}] nothing from stage 0 for {args.idle_timeout:g} s; leaving", file=sys.stderr)
        return 0 if ended else 4
    return drive(args, client, stage, folder, cfg, dtype, draft_device, graphs)


def drive(args, client, stage, folder, cfg, dtype, draft_device, graphs) -> int:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # a checkpoint without tokenizer files still runs on --prompt-ids
        if not args.prompt_ids:
            raise SystemExit(f"error: cannot load the tokenizer of {args.target}: {e}")
        tokenizer = None
    prompts = prompts_of(args, tokenizer)
    try:
        drafter = make_drafter(args.draft, args.target, stage, dtype=dtype, device=draft_device, max_len=args.max_len)
    except (CheckpointError, ConfigError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    metrics = MetricsWriter(args.metrics_dir) if args.metrics_dir else None
    progress = Progress() if not args.quiet and not args.stream else None
    streamer = TextStream(tokenizer) if args.stream and tokenizer is not None else None
    driver = Driver(client, stage, drafter, graphs=graphs, metrics=metrics, progress=progress,
                    on_tokens=streamer.update if streamer else None)
    sampling = Sampling(args.temperature, args.top_p, args.top_k, args.seed)
    opts = RunOptions(args.max_new_tokens, args.k, args.adaptive_k, args.depth, not args.no_overlap,
                      max(0, args.branches), sampling, stage_timeout_s=args.stage_timeout)
    eos = eos_ids(folder, cfg, tokenizer)
    stop = stop_rule(tokenizer, args.stop or [])
    code = 0
    try:
        driver.wait_ready(timeout=args.ready_timeout)
        ping_ms = driver.ping_stages() if metrics else {}
        for ids in prompts:
            try:
                result = driver.generate(ids, opts, eos, stop)
            except StageTimeout as e:
                partial = driver.partial
                print(f"\nerror: {e}", file=sys.stderr)
                if metrics:
                    metrics.summary({"token_ids": partial,
                                     "text": tokenizer.decode(partial, skip_special_tokens=True) if tokenizer else "",
                                     "finish_reason": "error", "error": str(e)})
                code = 3
                break
            result["text"] = tokenizer.decode(result["token_ids"], skip_special_tokens=True) if tokenizer else ""
            if progress:
                progress.done()
            summary = metrics.summary(result, {"k": args.k, "depth": args.depth, "overlap": not args.no_overlap,
                                               "draft": args.draft, "stages": args.stages,
                                               "ping_ms": ping_ms}) if metrics else result
            if streamer:
                streamer.done()
            if args.json:
                print(json.dumps({k: result[k] for k in JSON_KEYS}), flush=True)
            elif not streamer:
                print(result["text"], flush=True)
                print(f"[kit] {result['generated_tokens']} tokens, {summary['tps']:.1f} tok/s, "
                      f"{result['tokens_per_round']:.2f} tokens/round, TTFT {result['ttft_ms']:.0f} ms",
                      file=sys.stderr)
    except StageTimeout as e:
        print(f"error: {e}", file=sys.stderr)
        code = 3
    finally:
        if code == 0:
            memory = driver.end()
            if metrics:
                (metrics.folder / "memory.json").write_text(json.dumps(memory, indent=1))
        client.close()
        if metrics:
            metrics.close()
    return code


class TextStream:
    """Print the answer as rounds commit it (decoding the whole answer each time keeps multi-token
    characters whole)."""

    def __init__(self, tokenizer, stream=sys.stdout):
        self.tokenizer, self.stream, self.shown = tokenizer, stream, ""

    def update(self, ids: list[int]) -> None:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if text.startswith(self.shown) and not text.endswith("\ufffd"):
            self.stream.write(text[len(self.shown):])
            self.stream.flush()
            self.shown = text

    def done(self) -> None:
        self.stream.write("\n")
        self.stream.flush()
        self.shown = ""


JSON_KEYS = ("token_ids", "text", "prompt_tokens", "generated_tokens", "rounds", "tokens_per_round", "tps",
             "ttft_ms", "finish_reason")
