"""Latency the relay adds per round trip, and its throughput, on loopback (`python -m kit bench relay`).

Node A sends a frame to node B, B sends it back, A times the round trip: once over a direct TCP socket
(the baseline) and once through a real `python -m relay` process. Added latency = relay quantile minus
direct quantile. B runs in its own process; both sides use the same raw framing code, so the difference is
the relay alone. Also timed: the same through TLS, and through the kit's own RelayClient.
"""
from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import platform
import re
import secrets
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/relay_bench.py`
    sys.path.insert(0, str(ROOT))

from bench.common import command_line, cpu_model  # noqa: E402

from relay.protocol import (FrameType, client_handshake, encode_control, encode_header,  # noqa: E402
                            pinned_tls_wrap, read_frame, session_id)

TARGET_ADDED_P50_MS = 0.25


def _send(sock, ftype: int, src: int, dst: int, round_id: int, session: int, payload) -> None:
    header = encode_header(ftype, src, dst, round_id, 0, session, len(payload))
    if not isinstance(sock, ssl.SSLSocket):
        views = [memoryview(part) for part in (header, payload) if len(part)]
        while views:  # header and payload in one syscall, as the kit's client does
            n = sock.sendmsg(views)
            while n and views:
                if n >= len(views[0]):
                    n -= len(views.pop(0))
                else:
                    views[0], n = views[0][n:], 0
    else:
        sock.sendall(header + payload)


def _dial(address: tuple, stage: int, session: str | None, fingerprint: str | None, token: str):
    sock = socket.create_connection(address, timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if fingerprint:
        sock = pinned_tls_wrap(sock, fingerprint)
    if session:
        client_handshake(sock, session, stage, 2, token)
    return sock


def echo_raw(address: tuple, session: str | None, fingerprint: str | None, token: str, ready) -> None:
    """Node B: TENSOR frames go back to A, TOKENS frames are only counted, CONTROL answers with the count."""
    sock = _dial(address, 1, session, fingerprint, token)
    ready.set()
    received = 0
    while True:
        try:
            f = read_frame(sock)
        except (ConnectionError, OSError):
            return
        if f.type == FrameType.TENSOR:
            _send(sock, f.type, 1, 0, f.round_id, f.session, f.payload)
        elif f.type == FrameType.TOKENS:
            received += len(f.payload)
        elif f.type == FrameType.CONTROL:
            _send(sock, FrameType.CONTROL, 1, 0, f.round_id, f.session, encode_control({"received": received}))
            received = 0
        elif f.type == FrameType.BYE:
            return


def echo_client(address: str, session: str, fingerprint: str | None, token: str, ready) -> None:
    """Node B through the kit's RelayClient."""
    from kit.client import ConnectionLost, RelayClient
    client = RelayClient(address, session, 1, 2, token, fingerprint)
    client.connect()
    ready.set()
    try:
        while True:
            f = client.recv()
            if f.type == FrameType.BYE:
                break
            client.send(0, f.type, f.payload, f.round_id)
    except ConnectionLost:
        pass
    client.close()


def _quantiles(times: list) -> dict:
    ms = sorted(t * 1000 for t in times)
    return {"p50_ms": round(statistics.median(ms), 4), "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 4),
            "mean_ms": round(statistics.fmean(ms), 4), "n": len(ms)}


def _ping_pong(sock, sid: int, payload: bytes, n: int) -> list:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        _send(sock, FrameType.TENSOR, 0, 1, i, sid, payload)
        f = read_frame(sock)
        times.append(time.perf_counter() - t0)
        if f.round_id != i or len(f.payload) != len(payload):
            raise RuntimeError("echo returned the wrong frame")
    return times


def _stream(sock, sid: int, frame: bytes, total: int) -> float:
    """Send `total` bytes in frames one way, wait for B's count; return MB/s."""
    t0 = time.perf_counter()
    for i in range(total // len(frame)):
        _send(sock, FrameType.TOKENS, 0, 1, i, sid, frame)
    _send(sock, FrameType.CONTROL, 0, 1, 0, sid, encode_control({}))
    reply = read_frame(sock)
    elapsed = time.perf_counter() - t0
    received = json.loads(bytes(reply.payload))["received"]
    if received != total // len(frame) * len(frame):
        raise RuntimeError(f"B received {received} bytes of {total}")
    return received / elapsed / 1e6


class Relay:
    """A `python -m relay` process on a free loopback port."""

    def __init__(self, workdir: Path, tls: bool):
        self.token = secrets.token_hex(16)
        token_file = workdir / "token"
        token_file.write_text(self.token + "\n")
        cmd = [sys.executable, "-m", "relay", "--host", "127.0.0.1", "--port", "0", "--token-file", str(token_file)]
        self.fingerprint = None
        if tls:
            cert, key = workdir / "cert.pem", workdir / "key.pem"
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                            "/CN=kit-relay-bench", "-keyout", str(key), "-out", str(cert)],
                           check=True, capture_output=True)
            cmd += ["--cert", str(cert), "--key", str(key)]
        self.log = workdir / f"relay{'-tls' if tls else ''}.log"
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stderr=self.log.open("w"), stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            m = re.search(r"event=listening .*?port=(\d+).*?fingerprint=(\S+)", self.log.read_text())
            if m:
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the relay did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        self.address = ("127.0.0.1", int(m.group(1)))
        if tls:
            self.fingerprint = m.group(2)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def _start(ctx, name: str, *args):
    # the child imports the target by module name: use `bench.relay_bench` whatever name this file was loaded as
    target = getattr(importlib.import_module("bench.relay_bench"), name)
    ready = ctx.Event()
    proc = ctx.Process(target=target, args=(*args, ready), daemon=True)
    proc.start()
    deadline = time.monotonic() + 30
    while not ready.wait(0.1):
        if not proc.is_alive() or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the echo process did not come up")
    return proc


def measure_raw(ctx, address: tuple, session: str | None, fingerprint: str | None, token: str, payload: bytes,
                n: int, stream_bytes: int, listener: socket.socket | None = None) -> tuple:
    """Round-trip times and one-way MB/s between A (here) and B (a child process)."""
    proc = _start(ctx, "echo_raw", address, session, fingerprint, token)
    if listener is not None:
        sock, _ = listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    else:
        sock = _dial(address, 0, session, fingerprint, token)
    sock.settimeout(60)
    sid = session_id(session) if session else 0
    try:
        _ping_pong(sock, sid, payload, max(50, n // 10))  # warm up
        times = _ping_pong(sock, sid, payload, n)
        mbps = _stream(sock, sid, os.urandom(1 << 20), stream_bytes) if stream_bytes else None
        _send(sock, FrameType.BYE, 0, 1, 0, sid, b"")
    finally:
        sock.close()
        proc.join(10)
    return times, mbps


def measure_client(ctx, address: tuple, fingerprint: str | None, token: str, payload: bytes, n: int) -> list:
    from kit.client import RelayClient
    addr = f"{address[0]}:{address[1]}"
    proc = _start(ctx, "echo_client", addr, "bench-client", fingerprint, token)
    times = []
    with RelayClient(addr, "bench-client", 0, 2, token, fingerprint) as a:
        for i in range(max(50, n // 10) + n):
            t0 = time.perf_counter()
            a.send(1, FrameType.TENSOR, payload, i)
            f = a.recv(30)
            times.append(time.perf_counter() - t0)
            if f is None or f.round_id != i:
                raise RuntimeError("the echo through RelayClient lost a frame")
        a.send(1, FrameType.BYE)
    proc.join(10)
    return times[max(50, n // 10):]


def run(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()[0]
    ctx = multiprocessing.get_context("spawn")
    payload = os.urandom(args.frame_kb * 1024)
    stream = args.stream_mb << 20
    with tempfile.TemporaryDirectory(prefix="kit-relay-bench-") as tmp:
        listener = socket.create_server(("127.0.0.1", 0))
        direct_t, direct_mbps = measure_raw(ctx, listener.getsockname(), None, None, "", payload,
                                            args.round_trips, stream, listener)
        listener.close()
        relay = Relay(Path(tmp), tls=False)
        try:
            relay_t, relay_mbps = measure_raw(ctx, relay.address, "bench-plain", None, relay.token, payload,
                                              args.round_trips, stream)
            client_t = measure_client(ctx, relay.address, None, relay.token, payload, args.round_trips)
        finally:
            relay.stop()
        tls = None
        if not args.no_tls and shutil.which("openssl"):
            relay = Relay(Path(tmp), tls=True)
            try:
                tls_t, tls_mbps = measure_raw(ctx, relay.address, "bench-tls", relay.fingerprint, relay.token,
                                              payload, args.round_trips, stream)
                tls = {**_quantiles(tls_t), "throughput_mb_s": round(tls_mbps, 1)}
            finally:
                relay.stop()
    direct, through = _quantiles(direct_t), _quantiles(relay_t)
    added_p50 = round(through["p50_ms"] - direct["p50_ms"], 4)
    return {
        "benchmark": "relay",
        "command": args.command or command_line(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hardware": {"platform": platform.platform(), "machine": platform.machine(), "cpu": cpu_model(),
                     "cpu_count": os.cpu_count(),
                     "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]},  # before, after
        "python": sys.version.split()[0],
        "frame_bytes": len(payload),
        "round_trips": args.round_trips,
        "direct": direct,
        "relay": through,
        "added_p50_ms": added_p50,
        "added_p99_ms": round(through["p99_ms"] - direct["p99_ms"], 4),
        "target_added_p50_ms": TARGET_ADDED_P50_MS,
        "ratio_to_target": round(added_p50 / TARGET_ADDED_P50_MS, 3),
        "meets_target": added_p50 <= TARGET_ADDED_P50_MS,
        "throughput_mb_s": {"frame_bytes": 1 << 20, "total_bytes": stream, "direct": round(direct_mbps, 1),
                            "relay": round(relay_mbps, 1)},
        "relay_tls": tls,
        "kit_client_through_relay": _quantiles(client_t),
        "notes": "added = relay quantile - direct quantile; A here, B in a child process, relay in a third; "
                 "relay_tls and kit_client rows are round trips through the relay (TLS; the kit's RelayClient "
                 "on both ends)",
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kit bench relay", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--round-trips", type=int, default=3000, help="timed round trips per path")
    p.add_argument("--frame-kb", type=int, default=64, help="frame payload size for the round trips, KiB")
    p.add_argument("--stream-mb", type=int, default=512,
                   help="MiB sent one way in 1 MiB frames for the throughput figure (0: skip)")
    p.add_argument("--no-tls", action="store_true", help="skip the TLS row (it also needs the openssl CLI)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "relay_loopback.json",
                   help="where to write the JSON result")
    p.add_argument("--command", default=None, help="command line to record in the JSON (default: this one)")
    args = p.parse_args(argv)
    if args.round_trips < 1 or args.frame_kb < 1 or args.stream_mb < 0:
        p.error("--round-trips and --frame-kb must be positive, --stream-mb not negative")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        print(f"error: relay benchmark failed: {e}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    d, r = result["direct"], result["relay"]
    print(f"64 KiB round trip  direct p50 {d['p50_ms']:.3f} ms p99 {d['p99_ms']:.3f} ms | relay p50 "
          f"{r['p50_ms']:.3f} ms p99 {r['p99_ms']:.3f} ms | added p50 {result['added_p50_ms']:.3f} ms "
          f"(target {TARGET_ADDED_P50_MS} ms, {'met' if result['meets_target'] else 'MISSED'})")
    t = result["throughput_mb_s"]
    print(f"throughput (1 MiB frames)  direct {t['direct']} MB/s | relay {t['relay']} MB/s")
    if result["relay_tls"]:
        s = result["relay_tls"]
        print(f"through the relay with TLS  p50 {s['p50_ms']:.3f} ms p99 {s['p99_ms']:.3f} ms, "
              f"{s['throughput_mb_s']} MB/s")
    k = result["kit_client_through_relay"]
    print(f"through the relay with kit.client.RelayClient  p50 {k['p50_ms']:.3f} ms p99 {k['p99_ms']:.3f} ms")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
