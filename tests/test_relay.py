"""The relay as a real process on loopback: routing, authentication, attacks, TLS pinning, restarts, operations."""
from __future__ import annotations

import base64
import os
import select
import socket
import subprocess
import sys
import threading
import time

import pytest
from relay_helpers import (ROOT, RecordingProxy, RelayProcess, drain_until_closed, frames_in, raw_connect,
                           raw_node)

from kit import client as client_module
from kit.client import ConnectionLost, RelayClient
from relay.protocol import (RELAY, AuthError, ErrorCode, FingerprintMismatch, Frame, FrameType,
                            client_handshake, decode_control, decode_error, decode_tensor, decode_tokens,
                            encode_control, encode_frame, encode_header, encode_hello, encode_tensor, encode_tokens,
                            normalize_fingerprint, pinned_tls_wrap, ProtocolError, read_frame, session_id)

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def relay(tmp_path_factory):
    """One relay for the tests that do not restart or reconfigure it; attacks here must not be rate-limited."""
    r = RelayProcess(tmp_path_factory.mktemp("relay"), "--auth-failures", "0", "--handshake-timeout", "1",
                     "--stage-wait", "1", "--max-frame-mb", "1")
    yield r
    assert r.stop() == 0
    assert "level=error" not in r.log() and "Traceback" not in r.log()


def node(relay: RelayProcess, session: str, stage: int, stages: int, token=None, fingerprint=None,
         **kw) -> RelayClient:
    c = RelayClient(relay.address, session, stage, stages, relay.token if token is None else token,
                    fingerprint or relay.fingerprint, **kw)
    c.connect()
    return c


def error_code(frame: Frame) -> ErrorCode:
    assert frame.type == FrameType.ERROR
    return ErrorCode(decode_error(frame.payload)["code"])


class Exchange:
    """Stages 0 and 1 of a healthy session bouncing numbered frames while something else goes on."""

    def __init__(self, relay: RelayProcess, session: str = "healthy"):
        self.a, self.b = node(relay, session, 0, 2), node(relay, session, 1, 2)
        self.count, self.error = 0, None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            i = 0
            while not self.stop.is_set():
                self.a.send(1, FrameType.TOKENS, encode_tokens([i, i + 1], {"seq": i}), round_id=i)
                f = self.b.recv(5)
                assert f is not None and f.round_id == i and decode_tokens(f.payload) == ([i, i + 1], {"seq": i})
                self.b.send(0, FrameType.TOKENS, f.payload, round_id=i)
                g = self.a.recv(5)
                assert g is not None and g.round_id == i and g.src == 1
                i += 1
                self.count = i
        except BaseException as e:  # reported by check()
            self.error = e

    def progressed(self, rounds: int = 20, timeout: float = 10.0) -> None:
        start, deadline = self.count, time.monotonic() + timeout
        while self.count < start + rounds:
            assert self.error is None, f"healthy session broke: {self.error!r}"
            assert time.monotonic() < deadline, "healthy session stalled"
            time.sleep(0.01)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert self.error is None, f"healthy session broke: {self.error!r}"
        assert self.a.reconnects == 0 and self.b.reconnects == 0, "healthy session had to reconnect"
        self.a.close()
        self.b.close()


# --- routing and payloads ------------------------------------------------------------------------------------------

def test_ring_routes_frames_and_payloads(relay):
    nodes = [node(relay, "ring", i, 3) for i in range(3)]
    try:
        data = bytes(range(256)) * 8  # 2048 bytes = 4 x 256 float16
        nodes[0].send(1, FrameType.TENSOR, encode_tensor({"round": 7, "pos": [3, 4]}, "float16", (4, 256), data),
                      round_id=7, flags=5)
        f = nodes[1].recv(5)
        assert (f.type, f.src, f.dst, f.round_id, f.flags, f.session) == (FrameType.TENSOR, 0, 1, 7, 5,
                                                                         session_id("ring"))
        meta, dtype, shape, view = decode_tensor(f.payload)
        assert (meta, dtype, shape, bytes(view)) == ({"round": 7, "pos": [3, 4]}, "float16", (4, 256), data)
        nodes[1].send(2, FrameType.TENSOR, f.payload, round_id=7)
        assert bytes(nodes[2].recv(5).payload) == bytes(f.payload)
        nodes[2].send(0, FrameType.TOKENS, encode_tokens([1, 2, 151_000], {"accepted": 2}), round_id=7)
        g = nodes[0].recv(5)
        assert (g.src, decode_tokens(g.payload)) == (2, ([1, 2, 151_000], {"accepted": 2}))
        nodes[0].send(2, FrameType.CONTROL, encode_control({"cmd": "stop"}))  # any stage may address any stage
        h = nodes[2].recv(5)
        assert (h.src, decode_control(h.payload)) == (0, {"cmd": "stop"})
        assert 0 < nodes[0].ping() < 1000
        assert 0 < nodes[0].ping(dst=2) < 1000
        nodes[0].send(9, FrameType.TENSOR, b"x", round_id=3)  # no stage 9 in a 3-stage session
        e = nodes[0].recv(5)
        assert (error_code(e), e.round_id, e.src) == (ErrorCode.BAD_ROUTE, 3, RELAY)
        with pytest.raises(ValueError):
            nodes[0].send(1, FrameType.TENSOR, bytes((1 << 20) + 1))  # over this relay's 1 MiB limit
        assert nodes[0].bytes_sent > 2048 and nodes[1].bytes_received > 2048
    finally:
        for n in nodes:
            n.close()


def test_a_spinning_wait_gets_frames_times_out_and_stops_spinning(relay, monkeypatch):
    """recv(due=...) with spin_s, as the ring's nodes wait for a frame they expect: a frame that comes
    while it polls (taken at once) or after it arrives whole; with nothing sent it returns None at its
    timeout, not before; and it polls only for SPIN_MAX_S, so a wrong guess of the arrival does not keep
    a core busy."""
    a, b = node(relay, "spin", 0, 2), node(relay, "spin", 1, 2, spin_s=0.005)
    try:
        t = time.perf_counter()
        assert b.recv(0.05, due=t + 0.01) is None and time.perf_counter() - t >= 0.05
        for delay in (0.002, 0.05):  # inside the 10 ms it polls, and after it
            threading.Timer(delay, a.send, (1, FrameType.TOKENS, encode_tokens([7], {"d": delay}))).start()
            f = b.recv(5, due=time.perf_counter())
            assert f is not None and decode_tokens(f.payload) == ([7], {"d": delay})
        cpu = time.process_time()
        assert b.recv(0.4, due=time.perf_counter()) is None
        assert time.process_time() - cpu < 0.2  # polled 10 ms, then slept
        monkeypatch.setattr(client_module, "SPIN_MAX_S", 1.0)
        threading.Timer(0.05, a.send, (1, FrameType.TOKENS, encode_tokens([8], {}))).start()
        t = time.perf_counter()
        f = b.recv(5, due=t)  # the frame lands inside a 1 s polling window: taken then, not when it ends
        assert f is not None and decode_tokens(f.payload)[0] == [8] and time.perf_counter() - t < 0.5
    finally:
        a.close()
        b.close()


def test_frames_to_absent_stage_wait_then_error(relay):
    a = node(relay, "absent", 0, 3)
    try:
        a.send(1, FrameType.TENSOR, b"first", round_id=1)
        a.send(1, FrameType.TENSOR, b"second", round_id=2)
        late = node(relay, "absent", 1, 3)  # joins within the 1 s wait: gets both, in order
        assert [bytes(late.recv(5).payload) for _ in range(2)] == [b"first", b"second"]
        t0 = time.monotonic()
        a.send(2, FrameType.TENSOR, b"lost?", round_id=42)  # stage 2 never comes
        e = a.recv(5)
        assert time.monotonic() - t0 >= 0.9
        err = decode_error(e.payload)
        assert (error_code(e), e.round_id, err["stage"], err["type"]) == (ErrorCode.STAGE_UNAVAILABLE, 42, 2,
                                                                          FrameType.TENSOR)
        late.close()
    finally:
        a.close()


def test_reconnect_replaces_stale_connection(relay):
    a, b1 = node(relay, "replace", 0, 2), node(relay, "replace", 1, 2)
    b2 = node(relay, "replace", 1, 2)
    try:
        with pytest.raises(ConnectionLost, match="taken over"):
            b1.recv(5)
        a.send(1, FrameType.TENSOR, b"to the new one")
        assert bytes(b2.recv(5).payload) == b"to the new one"
        assert b2.welcome["replaced"] is True
    finally:
        for c in (a, b1, b2):
            c.close()


# --- authentication and secrecy ------------------------------------------------------------------------------------

def test_wrong_token_rejected(relay):
    before = relay.metrics()["kit_relay_auth_failures_total"]
    t0 = time.monotonic()
    with pytest.raises(AuthError) as e:
        node(relay, "s", 0, 2, token="not-the-token")
    assert e.value.code == ErrorCode.AUTH_FAILED and time.monotonic() - t0 < 5  # refused, not retried
    sock = raw_connect(relay.address)
    with pytest.raises(AuthError):
        client_handshake(sock, "s", 0, 2, b"also wrong")
    assert drain_until_closed(sock, 3) == []
    assert relay.metrics()["kit_relay_auth_failures_total"] == before + 2


def test_token_never_on_the_wire_or_in_logs(relay):
    proxy = RecordingProxy(relay.address)
    a = RelayClient(proxy.address, "secret", 0, 2, relay.token)
    a.connect()
    b = node(relay, "secret", 1, 2)
    try:
        a.send(1, FrameType.CONTROL, encode_control({"hello": "world"}))
        assert decode_control(b.recv(5).payload) == {"hello": "world"}
        b.send(0, FrameType.TOKENS, encode_tokens([1, 2, 3], {}))
        assert decode_tokens(a.recv(5).payload)[0] == [1, 2, 3]
        a.ping()
    finally:
        a.close()
    time.sleep(0.2)
    types_up = [t for t, _ in frames_in(proxy.up)]
    assert types_up[:2] == [FrameType.HELLO, FrameType.AUTH] and FrameType.CONTROL in types_up
    token = relay.token.encode()
    for needle in (token, bytes.fromhex(relay.token), base64.b64encode(token), base64.b64encode(bytes.fromhex(
            relay.token)), token.upper()):
        assert needle not in proxy.up and needle not in proxy.down
        assert needle.decode("latin-1") not in relay.log()

    # replaying the recorded client bytes on a new connection gets nowhere: fresh nonce, AUTH no longer valid
    replay = raw_connect(relay.address)
    replay.sendall(bytes(proxy.up))
    frames = drain_until_closed(replay, 3)
    assert [f.type for f in frames] == [FrameType.CHALLENGE, FrameType.ERROR]
    assert error_code(frames[-1]) == ErrorCode.AUTH_FAILED
    assert b.recv(0.5) is None  # the replayed CONTROL frame never reached stage 1
    b.close()
    proxy.close()


class Tap:
    """A socket that remembers what was sent through it."""

    def __init__(self, sock: socket.socket):
        self.sock, self.sent = sock, []

    def sendall(self, data) -> None:
        self.sent.append(bytes(data))
        self.sock.sendall(data)

    def recv_into(self, view) -> int:
        return self.sock.recv_into(view)


# --- attacks: each closes only the offending connection ----------------------------------------------------------

def attack_garbage(relay):
    s = raw_connect(relay.address)
    s.sendall(b"GET / HTTP/1.1\r\nHost: relay\r\n\r\n" + os.urandom(200))
    return s, ErrorCode.BAD_MAGIC


def attack_truncated_header(relay):
    s = raw_connect(relay.address)
    s.sendall(encode_header(FrameType.HELLO, 0, RELAY, 0, 0, session_id("x"), 40)[:11])
    return s, ErrorCode.HANDSHAKE_TIMEOUT


def attack_oversize_before_auth(relay):
    s = raw_connect(relay.address)
    s.sendall(encode_header(FrameType.HELLO, 0, RELAY, 0, 0, session_id("x"), 50 << 20))
    return s, ErrorCode.TOO_LARGE


def attack_oversize_after_auth(relay):
    s = raw_node(relay.address, "intruder", 0, 2, relay.token)
    s.sendall(encode_header(FrameType.TENSOR, 0, 1, 0, 0, session_id("intruder"), 2 << 20) + bytes(1000))
    return s, ErrorCode.TOO_LARGE


def attack_slowloris(relay):
    s = raw_connect(relay.address)
    hello = encode_frame(Frame(FrameType.HELLO, 0, RELAY, session=session_id("x"),
                               payload=encode_hello("x", 2, bytes(32))))
    for byte in hello[:4]:  # a byte now and then, never a whole HELLO
        s.sendall(bytes([byte]))
        time.sleep(0.15)
    return s, ErrorCode.HANDSHAKE_TIMEOUT


def attack_replayed_auth(relay):
    tap = Tap(raw_connect(relay.address))
    client_handshake(tap, "recorded", 1, 2, relay.token)  # a genuine handshake, recorded
    tap.sock.close()
    hello, auth = tap.sent
    s = raw_connect(relay.address)
    s.sendall(hello)
    assert read_frame(s).type == FrameType.CHALLENGE
    s.sendall(auth)
    return s, ErrorCode.AUTH_FAILED


def attack_frame_before_hello(relay):
    s = raw_connect(relay.address)
    s.sendall(encode_frame(Frame(FrameType.TENSOR, 0, 1, session=session_id("healthy"), payload=b"inject")))
    return s, ErrorCode.BAD_STATE


def attack_future_version(relay):
    s = raw_connect(relay.address)
    head = bytearray(encode_header(FrameType.HELLO, 0, RELAY, 0, 0, 0, 0))
    head[2] = 99
    s.sendall(head)
    return s, ErrorCode.BAD_VERSION


def attack_spoofed_session(relay):
    s = raw_node(relay.address, "intruder", 0, 2, relay.token)
    s.sendall(encode_frame(Frame(FrameType.TENSOR, 0, 1, session=session_id("healthy"), payload=b"inject")))
    return s, ErrorCode.BAD_ROUTE


ATTACKS = [attack_garbage, attack_truncated_header, attack_oversize_before_auth, attack_oversize_after_auth,
           attack_slowloris, attack_replayed_auth, attack_frame_before_hello, attack_future_version,
           attack_spoofed_session]


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.__name__[7:] for a in ATTACKS])
def test_attack_closes_only_the_offender(relay, attack):
    healthy = Exchange(relay)
    try:
        healthy.progressed()
        sock, expected = attack(relay)
        frames = drain_until_closed(sock, 4)
        assert frames and error_code(frames[-1]) == expected
        healthy.progressed()
    finally:
        healthy.close()


def test_third_party_cannot_join_or_read(relay):
    a, b = node(relay, "private", 0, 2), node(relay, "private", 1, 2)
    other = node(relay, "other", 1, 2)
    same_name_other_shape = node(relay, "private", 1, 3)  # a different session: (id, stage count)
    try:
        with pytest.raises(AuthError):
            node(relay, "private", 1, 2, token="guess")
        a.send(1, FrameType.TENSOR, b"for stage 1 of private only")
        assert bytes(b.recv(5).payload) == b"for stage 1 of private only"
        assert other.recv(0.5) is None and same_name_other_shape.recv(0.01) is None
        other.send(0, FrameType.TENSOR, b"hi")  # stage 0 of "other" does not exist: queued, then an error
        same_name_other_shape.send(0, FrameType.TENSOR, b"hi")
        assert a.recv(1.5) is None
        assert error_code(other.recv(5)) == ErrorCode.STAGE_UNAVAILABLE
        assert b.reconnects == 0 and a.reconnects == 0
    finally:
        for c in (a, b, other, same_name_other_shape):
            c.close()


# --- TLS -----------------------------------------------------------------------------------------------------------

def test_tls_pinning(tmp_path):
    r = RelayProcess(tmp_path, "--auth-failures", "0", tls=True)
    try:
        wrong = "SHA256:" + "AB" * 32
        with pytest.raises(FingerprintMismatch):
            node(r, "tls", 0, 2, fingerprint=wrong)
        with pytest.raises(FingerprintMismatch):
            pinned_tls_wrap(raw_connect(r.address), wrong)
        time.sleep(0.3)
        m = r.metrics()
        assert m["kit_relay_hello_total"] == 0 and m["kit_relay_auth_failures_total"] == 0  # nothing reached it

        colons_lower = ":".join(r.fingerprint[7:][i:i + 2] for i in range(0, 64, 2)).lower()
        a = node(r, "tls", 0, 2, fingerprint=colons_lower)
        b = node(r, "tls", 1, 2)
        try:
            assert r.metrics()["kit_relay_hello_total"] == 2
            big = os.urandom(3 << 20)
            errors = []

            def pump(src: RelayClient, dst: RelayClient, dst_stage: int) -> None:
                try:  # both directions at once: the TLS link is read and written by two threads
                    for i in range(20):
                        src.send(dst_stage, FrameType.TENSOR, big[i:i + (1 << 20) + i], round_id=i)
                    for i in range(20):
                        f = dst.recv(20)
                        assert f.round_id == i and bytes(f.payload) == big[i:i + (1 << 20) + i]
                except BaseException as e:
                    errors.append(e)

            threads = [threading.Thread(target=pump, args=(a, b, 1)), threading.Thread(target=pump, args=(b, a, 0))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errors, errors
            assert a.ping() > 0
        finally:
            a.close()
            b.close()
        with pytest.raises((OSError, ProtocolError)):  # a plain-TCP client cannot talk to the TLS port
            client_handshake(raw_connect(r.address), "tls", 0, 2, r.token)
    finally:
        assert r.stop() == 0


def test_fingerprint_forms_are_one():
    fp = "SHA256:" + "0A" * 32
    for form in ("0a" * 32, ":".join(["0A"] * 32), "sha256:" + ":".join(["0a"] * 32),
                 "sha256 Fingerprint=" + ":".join(["0A"] * 32), f"  {fp}\n"):
        assert normalize_fingerprint(form) == fp
    for bad in ("", "SHA256:abc", "0G" * 32, "SHA256:" + "0A" * 31):
        with pytest.raises(ValueError):
            normalize_fingerprint(bad)


# --- failures and restarts -----------------------------------------------------------------------------------------

def test_relay_restart_clients_reconnect(tmp_path):
    r = RelayProcess(tmp_path, "--auth-failures", "0")
    a, b = node(r, "restart", 0, 2), node(r, "restart", 1, 2)
    try:
        a.send(1, FrameType.TENSOR, b"before")
        assert bytes(b.recv(5).payload) == b"before"
        assert r.stop() == 0  # SIGTERM: clean exit, stages told goodbye
        assert "event=stopped" in r.log()
        time.sleep(0.5)
        r.start()  # same port
        a.send(1, FrameType.TENSOR, b"after", round_id=1)  # waits for the relay, then for stage 1 to rejoin
        f = b.recv(20)
        assert (bytes(f.payload), f.round_id) == (b"after", 1)
        b.send(0, FrameType.TENSOR, b"and back")
        assert bytes(a.recv(10).payload) == b"and back"
        assert a.reconnects >= 1 and b.reconnects >= 1
    finally:
        a.close()
        b.close()
        r.stop()


def test_client_gives_up_after_deadline(tmp_path):
    r = RelayProcess(tmp_path)
    a = node(r, "gone", 0, 2, reconnect_deadline=1.0)
    r.stop()
    t0 = time.monotonic()
    with pytest.raises(ConnectionLost, match=r"the link to the relay broke \(.+\); cannot reach"):
        a.recv(10)
    assert time.monotonic() - t0 < 5
    with pytest.raises(ConnectionLost):
        a.send(1, FrameType.TENSOR, b"x")
    a.close()


def test_failed_auth_is_rate_limited(tmp_path):
    r = RelayProcess(tmp_path, "--auth-failures", "3", "--auth-window", "600")
    try:
        for _ in range(3):
            with pytest.raises(AuthError) as e:
                node(r, "rl", 0, 2, token="wrong")
            assert e.value.code == ErrorCode.AUTH_FAILED
        with pytest.raises(AuthError) as e:  # now even the right token is refused from this address
            client_handshake(raw_connect(r.address), "rl", 0, 2, r.token)
        assert e.value.code == ErrorCode.RATE_LIMITED
        with pytest.raises(ConnectionLost):
            node(r, "rl", 0, 2, reconnect_deadline=0.5)
        m = r.metrics()
        assert m["kit_relay_auth_failures_total"] == 3 and m["kit_relay_refused_total"] >= 2
    finally:
        r.stop()


def test_idle_connections_closed_heartbeats_keep_clients(tmp_path):
    r = RelayProcess(tmp_path, "--auth-failures", "0", "--idle-timeout", "1")
    try:
        silent = raw_node(r.address, "idle", 1, 2, r.token)
        c = node(r, "idle", 0, 2)
        frames = drain_until_closed(silent, 4)
        assert error_code(frames[-1]) == ErrorCode.IDLE_TIMEOUT
        time.sleep(2.5)  # the client's heartbeats keep it alive
        assert c.ping() > 0 and c.reconnects == 0
        c.close()
    finally:
        r.stop()


def test_slow_reader_gets_backpressure_not_unbounded_buffers(tmp_path):
    r = RelayProcess(tmp_path, "--auth-failures", "0", "--write-buffer-mb", "1")
    try:
        reader = raw_node(r.address, "bp", 1, 2, r.token)  # authenticated, then reads nothing for a while
        writer = raw_node(r.address, "bp", 0, 2, r.token)
        rss0 = r.rss_kb()
        sid = session_id("bp")
        frame_payload = bytes(1 << 20)
        writer.setblocking(False)
        sent_frames, pending, stalled_since = 0, b"", None
        while sent_frames < 400:
            if not pending:
                pending = memoryview(encode_header(FrameType.TENSOR, 0, 1, sent_frames, 0, sid, 1 << 20)
                                     + frame_payload)
                sent_frames += 1
            try:
                pending = pending[writer.send(pending):]
                stalled_since = None
            except BlockingIOError:
                stalled_since = stalled_since or time.monotonic()
                if time.monotonic() - stalled_since > 1.0:
                    break
                select.select([], [writer], [], 0.05)
        assert sent_frames < 100, "the relay kept accepting bytes that nobody read"
        assert r.rss_kb() - rss0 < 48 * 1024
        writer.setblocking(True)
        got = []

        def read_all() -> None:
            reader.settimeout(10)
            for _ in range(sent_frames):
                got.append(read_frame(reader).round_id)

        t = threading.Thread(target=read_all)
        t.start()
        writer.sendall(pending)
        t.join(30)
        assert got == list(range(sent_frames))  # nothing lost or reordered on the way
    finally:
        r.stop()


# --- operations ----------------------------------------------------------------------------------------------------

def test_healthz_and_metrics(relay):
    assert relay.http("/healthz") == (200, "ok\n")
    assert relay.http("/nothing")[0] == 404
    before = relay.metrics()
    a, b = node(relay, "metrics", 0, 2), node(relay, "metrics", 1, 2)
    try:
        for i in range(10):
            a.send(1, FrameType.TENSOR, bytes(1000), round_id=i)
            b.recv(5)
        m = relay.metrics()
        assert m["kit_relay_sessions"] >= 1 and m["kit_relay_connections"] >= 2
        assert m['kit_relay_frames_total{direction="out"}'] >= before['kit_relay_frames_total{direction="out"}'] + 10
        assert m['kit_relay_bytes_total{direction="in"}'] >= before['kit_relay_bytes_total{direction="in"}'] + 10_280
        assert m["kit_relay_forward_seconds_count"] >= before["kit_relay_forward_seconds_count"] + 10
        assert m['kit_relay_forward_seconds_bucket{le="+Inf"}'] == m["kit_relay_forward_seconds_count"]
        for name in ("kit_relay_auth_failures_total", "kit_relay_hello_total", "kit_relay_auth_success_total",
                     "kit_relay_pending_handshakes", "kit_relay_queued_bytes", "kit_relay_refused_total"):
            assert name in m
    finally:
        a.close()
        b.close()


def test_cli_help_and_bad_input(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "relay", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30)

    out = run("--help").stdout
    for option in ("--port", "--host", "--token-file", "--cert", "--key", "--metrics-port", "--metrics-host",
                   "--max-frame-mb", "--handshake-timeout", "--idle-timeout", "--stage-wait", "--queue-mb",
                   "--total-queue-mb", "--write-buffer-mb", "--auth-failures", "--auth-window",
                   "--max-pending-per-addr", "--max-connections"):
        assert option in out
    missing = run("--token-file", str(tmp_path / "nope"))
    assert missing.returncode == 2 and missing.stderr.startswith("error: cannot use token file")
    assert len(missing.stderr.strip().splitlines()) == 1
    (tmp_path / "empty").write_text("  \n")
    assert run("--token-file", str(tmp_path / "empty")).returncode == 2
    half = run("--token-file", str(tmp_path / "empty"), "--cert", "c.pem")
    assert half.returncode == 2 and "--cert and --key go together" in half.stderr
