"""The WAN emulator as a real process in front of a real echo server on 127.0.0.1."""

import hashlib
import os
import random
import signal
import socket
import socketserver
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kit.wan import WanEmulator, per_link_delay_ms

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ending = "eof"
        try:
            while data := self.request.recv(1 << 16):
                self.request.sendall(data)
        except ConnectionResetError:
            ending = "reset"
        self.server.endings.append(ending)


@pytest.fixture
def echo():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    server.endings = []
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


class Emulator:
    """`python -m kit.wan` in a subprocess; stderr goes to a file so it can be read at any time."""

    def __init__(self, tmp_path: Path, upstream_port: int, *args: str):
        self.ready = tmp_path / f"ready{id(self)}"
        self.log = tmp_path / f"wan{id(self)}.log"
        self.ready.unlink(missing_ok=True)
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kit.wan", "--listen", "127.0.0.1:0", "--upstream",
                 f"127.0.0.1:{upstream_port}", "--ready-file", str(self.ready), *args],
                stderr=err, env=ENV, cwd=ROOT)
        deadline = time.monotonic() + 15
        while not self.ready.exists():
            assert self.proc.poll() is None, self.stderr()
            assert time.monotonic() < deadline, "emulator never became ready"
            time.sleep(0.01)
        self.port = int(self.ready.read_text())

    def stderr(self) -> str:
        return self.log.read_text()

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(10) == 0, self.stderr()
        assert "Traceback" not in self.stderr(), self.stderr()


@pytest.fixture
def start(tmp_path, echo):
    started = []

    def _start(*args: str, upstream_port: int | None = None) -> Emulator:
        emu = Emulator(tmp_path, upstream_port or echo.server_address[1], *args)
        started.append(emu)
        return emu

    yield _start
    for emu in started:
        emu.stop()


def recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(min(n - len(buf), 1 << 20))
        assert chunk, f"EOF after {len(buf)} of {n} bytes"
        buf += chunk
    return bytes(buf)


def echo_through(s: socket.socket, payload: bytes) -> bytes:
    """Send and receive concurrently (the echo would stall on full buffers otherwise)."""
    sender = threading.Thread(target=s.sendall, args=(payload,))
    sender.start()
    try:
        return recv_exactly(s, len(payload))
    finally:
        sender.join()


def round_trip_ms(s: socket.socket, payload: bytes, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        assert echo_through(s, payload) == payload
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def test_help_describes_every_option():
    out = subprocess.run([sys.executable, "-m", "kit.wan", "--help"], capture_output=True, text=True,
                         env=ENV, cwd=ROOT, timeout=30)
    assert out.returncode == 0
    for option in ("--listen", "--upstream", "--delay-ms", "--jitter-ms", "--bandwidth-mbit", "--seed",
                   "--ready-file", "--spin", "SIGUSR1"):
        assert option in out.stdout


@pytest.mark.parametrize("upstream", ["nohost", "127.0.0.1:notaport", "127.0.0.1:70000", "127.0.0.1:0",
                                      "nosuchhost.invalid:80"])
def test_bad_upstream_is_one_clear_line(upstream):
    out = subprocess.run([sys.executable, "-m", "kit.wan", "--listen", "127.0.0.1:0", "--upstream", upstream],
                         capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=30)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "--upstream" in out.stderr.strip().splitlines()[-1]


def test_unreachable_upstream_closes_client_and_keeps_serving(start):
    with socket.socket() as probe:  # a port with nothing listening
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    emu = start(upstream_port=dead_port)
    try:  # the RST may even beat connect() back to this thread
        with emu.connect() as s:
            assert s.recv(1) == b""
    except ConnectionResetError:
        pass
    time.sleep(0.1)
    assert emu.proc.poll() is None
    assert f"upstream 127.0.0.1:{dead_port} unreachable" in emu.stderr()


def test_round_trip_is_twice_the_one_way_delay(start):
    emu = start("--delay-ms", "20")
    with emu.connect() as s:
        rtt = round_trip_ms(s, b"ping", 10)
    assert 40 <= rtt <= 45, rtt
    assert "open #1" in emu.stderr()


def test_spinning_emulator_keeps_delay_and_data(start):
    """--spin (no sleeping, for benchmarks) changes when bytes are picked up, not the link: same delay,
    same bytes, and it still stops cleanly on SIGTERM."""
    emu = start("--delay-ms", "10", "--spin")
    payload = random.Random(1).randbytes(200_000)
    with emu.connect() as s:
        rtt = round_trip_ms(s, b"ping", 5)
        assert echo_through(s, payload) == payload
    assert 20 <= rtt <= 24, rtt


@pytest.mark.parametrize("delay,spin", [(0, False), (10, False), (10, True)])
def test_hops_add_little_beyond_the_delay(start, echo, delay, spin):
    """Each hop is released on time: a sleep that wakes late (epoll counts whole ms) once made the ring's 4
    emulated hops cost 4-6 ms of every measured round. Here 2 hops cost twice their delay plus a fraction
    of a millisecond more than the direct path, for a frame of the ring's size."""
    emu = start("--delay-ms", str(delay), *(["--spin"] if spin else []))
    frame = os.urandom(64 * 1024)
    with socket.create_connection(echo.server_address) as direct, emu.connect() as proxied:
        direct.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        round_trip_ms(direct, frame, 3), round_trip_ms(proxied, frame, 3)  # warm up
        base = round_trip_ms(direct, frame, 20)
        via = round_trip_ms(proxied, frame, 20)
    print(f"64 KiB round trip: direct {base:.3f} ms, via 2 x {delay} ms {via:.3f} ms")
    assert 0 <= via - 2 * delay - base < 1.0, (base, via)


def test_random_payloads_arrive_intact(start):
    emu = start("--delay-ms", "20", "--jitter-ms", "5", "--seed", "1")
    rng = random.Random(0)
    with emu.connect() as s:
        for size in (1, 1000, 65537, 3_000_000):
            payload = rng.randbytes(size)
            assert hashlib.sha256(echo_through(s, payload)).digest() == hashlib.sha256(payload).digest()


def test_half_close_travels_after_the_data(start):
    emu = start("--delay-ms", "10")
    with emu.connect() as s:
        s.sendall(b"bye")
        s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(100):
            got += chunk
    assert got == b"bye"
    deadline = time.monotonic() + 5
    while "close #1" not in emu.stderr() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "close #1 up=3 down=3" in emu.stderr()


def test_jitter_never_reorders(start):
    # Jitter (20 ms) far above the gap between messages (1 ms): only the FIFO rule keeps them in order.
    emu = start("--delay-ms", "5", "--jitter-ms", "20", "--seed", "7")
    messages = [f"<{i:05d}>".encode() for i in range(200)]
    with emu.connect() as s:
        t = time.perf_counter()
        for m in messages:
            s.sendall(m)
            time.sleep(0.001)
        got = recv_exactly(s, sum(map(len, messages)))
        elapsed = time.perf_counter() - t
    assert got == b"".join(messages)
    assert elapsed > 0.2  # the messages really were sent apart


def test_bandwidth_cap(start):
    emu = start("--bandwidth-mbit", "8")
    payload = os.urandom(1_000_000)  # 8 Mbit: 1 s each way, pipelined through the echo
    with emu.connect() as s:
        t = time.perf_counter()
        assert echo_through(s, payload) == payload
        elapsed = time.perf_counter() - t
    assert 0.95 <= elapsed <= 1.5, elapsed


def test_sigusr1_cuts_open_connections_and_new_ones_work(start, echo):
    emu = start("--delay-ms", "5")
    with emu.connect() as s:
        assert echo_through(s, b"before") == b"before"
        emu.proc.send_signal(signal.SIGUSR1)
        try:
            got = s.recv(1)
        except ConnectionResetError:
            got = b""
        assert got == b""
    deadline = time.monotonic() + 5
    while not echo.endings and time.monotonic() < deadline:
        time.sleep(0.01)
    assert echo.endings == ["reset"]  # the upstream side was cut too, with RST
    assert "cut #1" in emu.stderr()
    with emu.connect() as s:
        assert echo_through(s, b"after") == b"after"
    assert emu.proc.poll() is None


def test_in_process_api_counts_and_cuts(echo):
    emu = WanEmulator("127.0.0.1", echo.server_address[1], delay_ms=1)
    port = emu.start()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        assert echo_through(s, b"x" * 1000) == b"x" * 1000
        deadline = time.monotonic() + 5  # the counter moves just after send() returns, on the emulator's thread
        while emu.bytes_down < 1000 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert (emu.bytes_up, emu.bytes_down) == (1000, 1000)
        assert emu.cut_all() == 1 and emu.connections_cut == 1
        with pytest.raises(ConnectionResetError):  # RST: an EOF (b"") would not raise, and fail here
            s.recv(1)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        assert echo_through(s, b"again") == b"again"
        emu.close()
        assert s.recv(1) == b""  # close() ends connections with FIN
    assert not emu._thread.is_alive()


def test_per_link_delay_splits_ring_rtt_over_four_links():
    assert per_link_delay_ms(80) == 20
    assert per_link_delay_ms(0) == 0
