"""The relay: authenticates stages, joins the stages of each session, forwards their frames untouched.

One asyncio loop, standard library only (Python >= 3.8). A frame is read straight into one buffer
(header + payload) and that same buffer is handed to the destination's transport: no re-encoding.
"""
from __future__ import annotations

import asyncio
import bisect
import collections
import hmac
import json
import secrets
import signal
import socket
import ssl
import sys
import time
from dataclasses import dataclass

from relay.protocol import (HEADER_LEN, MAX_HANDSHAKE_PAYLOAD, NONCE_LEN, RELAY, VERSION, ErrorCode,
                            FrameType, ProtocolError, auth_mac, decode_hello, encode_control, encode_error,
                            encode_header, fingerprint_of_der, parse_header, session_id)

SCRATCH = 256 << 10  # one socket read when no large frame is being filled; shared, as reads never interleave
HANDSHAKE_TYPES = (FrameType.HELLO, FrameType.CHALLENGE, FrameType.AUTH, FrameType.WELCOME)
LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 10e-3, 50e-3, 0.25, 1.0, 5.0, 15.0, 60.0)


@dataclass
class Config:
    token: bytes
    host: str = "0.0.0.0"
    port: int = 7000
    cert: str | None = None
    key: str | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # 0: off
    max_payload: int = 16 << 20
    handshake_timeout: float = 5.0
    idle_timeout: float = 30.0
    stage_wait: float = 15.0
    queue_bytes: int = 32 << 20  # per absent stage
    total_queue_bytes: int = 128 << 20
    write_buffer: int = 2 << 20  # per connection, before its senders are paused
    auth_failures: int = 10  # per address and window; 0: no limit
    auth_window: float = 60.0
    max_pending_per_addr: int = 64
    max_connections: int = 1024


def log(event: str, level: str = "info", **kv) -> None:
    """One logfmt line on stderr. Values are quoted when needed so that no client string can forge a line."""
    parts = [time.strftime("ts=%Y-%m-%dT%H:%M:%SZ", time.gmtime()), f"level={level}", f"event={event}"]
    for k, v in kv.items():
        s = f"{v:.6g}" if isinstance(v, float) else str(v)
        if not s or not s.isprintable() or any(c in s for c in ' "=\\'):
            s = json.dumps(s)
        parts.append(f"{k}={s}")
    print(" ".join(parts), file=sys.stderr, flush=True)


class RateLimiter:
    """Token bucket of allowed failures per address: `burst` failures, refilled over `window` seconds."""

    def __init__(self, burst: int, window: float):
        self.burst, self.rate = burst, burst / window if window > 0 else float("inf")
        self.buckets: dict[str, tuple[float, float]] = {}

    def _level(self, addr: str, now: float) -> float:
        tokens, then = self.buckets.get(addr, (self.burst, now))
        return min(self.burst, tokens + (now - then) * self.rate)

    def blocked(self, addr: str) -> bool:
        return self.burst > 0 and self._level(addr, time.monotonic()) < 1

    def fail(self, addr: str) -> None:
        if self.burst > 0:
            now = time.monotonic()
            self.buckets[addr] = (self._level(addr, now) - 1, now)

    def sweep(self) -> None:
        now = time.monotonic()
        for addr in [a for a in self.buckets if self._level(a, now) >= self.burst]:
            del self.buckets[addr]


class Metrics:
    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.errors: collections.Counter = collections.Counter()
        self.frames_in = self.frames_out = self.bytes_in = self.bytes_out = 0
        self.latency = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0

    def observe(self, seconds: float) -> None:
        self.latency[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds


class Session:
    """The stages of one (session id, stage count): their connections and the frames waiting for absent ones."""

    def __init__(self, key: tuple, name: str, stages: int):
        self.key, self.name, self.stages = key, name, stages
        self.conns: list[Conn | None] = [None] * stages
        self.queues = [collections.deque() for _ in range(stages)]  # (deadline, t0, src, type, round_id, buf)
        self.queued = [0] * stages

    def empty(self) -> bool:
        return not any(self.conns) and not any(self.queues)


class Relay:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.sessions: dict[tuple, Session] = {}
        self.conns: set[Conn] = set()
        self.pending: collections.Counter = collections.Counter()
        self.limiter = RateLimiter(cfg.auth_failures, cfg.auth_window)
        self.metrics = Metrics()
        self.queued_total = 0
        self.closing = False
        self.scratch = memoryview(bytearray(SCRATCH))  # every byte read here is copied out before the next read

    # membership
    def register(self, conn: Conn) -> bool:
        """Seat an authenticated connection; a live one for the same place is replaced. Return True if replaced."""
        key = (conn.sid, conn.stages)
        sess = self.sessions.get(key)
        if sess is None:
            sess = self.sessions[key] = Session(key, conn.name, conn.stages)
            log("session_open", session=conn.name, sid=f"{conn.sid:016x}", stages=conn.stages)
        old = sess.conns[conn.stage]
        sess.conns[conn.stage] = conn
        conn.session = sess
        if old is not None:
            old.session = None
            self.metrics.counts["replaced"] += 1
            old.close_with(ErrorCode.REPLACED, "replaced by a newer authenticated connection of the same stage")
        return old is not None

    def unregister(self, conn: Conn) -> None:
        sess, conn.session = conn.session, None
        if sess is None or sess.conns[conn.stage] is not conn:
            return
        sess.conns[conn.stage] = None
        log("stage_down", session=sess.name, stage=conn.stage, peer=conn.peer)
        if sess.empty():
            del self.sessions[sess.key]
            log("session_closed", session=sess.name)

    def flush(self, conn: Conn) -> None:
        sess, stage = conn.session, conn.stage
        queue = sess.queues[stage]
        while queue:
            _, t0, _, _, _, buf = queue.popleft()
            sess.queued[stage] -= len(buf)
            self.queued_total -= len(buf)
            conn.write(buf, t0)

    # routing
    def route(self, conn: Conn, fields: tuple, buf, t0: float) -> None:
        ftype, _, src, dst, session, round_id, _ = fields
        if session != conn.sid or src != conn.stage:
            raise ProtocolError(ErrorCode.BAD_ROUTE, "the header names another session or stage than the "
                                                     "authenticated one")
        if dst == RELAY:
            if ftype == FrameType.PING:
                payload = memoryview(buf)[HEADER_LEN:]
                conn.send(encode_header(FrameType.PONG, RELAY, src, round_id, 0, session, len(payload)) + payload)
            elif ftype == FrameType.BYE:
                conn.close_with(None, "bye")
            elif ftype != FrameType.PONG:
                raise ProtocolError(ErrorCode.BAD_ROUTE, f"{ftype.name} cannot be addressed to the relay")
            return
        if ftype in HANDSHAKE_TYPES:
            raise ProtocolError(ErrorCode.BAD_STATE, f"{ftype.name} after the handshake")
        sess = conn.session
        if dst >= sess.stages:
            conn.send_error(ErrorCode.BAD_ROUTE, f"stage {dst} is not in 0..{sess.stages - 1}", round_id,
                            stage=dst, type=int(ftype))
            return
        target = sess.conns[dst]
        if target is not None:
            target.write(buf, t0)
            if target.write_paused:
                target.hold(conn)
            return
        if sess.queued[dst] + len(buf) > self.cfg.queue_bytes or \
                self.queued_total + len(buf) > self.cfg.total_queue_bytes:
            self.metrics.counts["stage_unavailable"] += 1
            conn.send_error(ErrorCode.STAGE_UNAVAILABLE, f"stage {dst} is not connected and its queue is full",
                            round_id, stage=dst, type=int(ftype))
            return
        sess.queues[dst].append((time.monotonic() + self.cfg.stage_wait, t0, src, ftype, round_id, buf))
        sess.queued[dst] += len(buf)
        self.queued_total += len(buf)

    def sweep(self) -> None:
        """Expire frames that waited too long for their stage, close idle connections."""
        now = time.monotonic()
        for sess in list(self.sessions.values()):
            for dst, queue in enumerate(sess.queues):
                while queue and queue[0][0] <= now:
                    _, _, src, ftype, round_id, buf = queue.popleft()
                    sess.queued[dst] -= len(buf)
                    self.queued_total -= len(buf)
                    self.metrics.counts["stage_unavailable"] += 1
                    sender = sess.conns[src]
                    log("stage_unavailable", session=sess.name, src=src, dst=dst, type=ftype.name, round=round_id,
                        notified=sender is not None and ftype != FrameType.ERROR)
                    if sender is not None and ftype != FrameType.ERROR:
                        sender.send_error(ErrorCode.STAGE_UNAVAILABLE,
                                          f"stage {dst} did not connect within {self.cfg.stage_wait:g} s",
                                          round_id, stage=dst, type=int(ftype))
            if sess.empty():
                del self.sessions[sess.key]
                log("session_closed", session=sess.name)
        for conn in list(self.conns):
            if conn.state == "open" and not conn.read_paused and now - conn.last_rx > self.cfg.idle_timeout:
                self.metrics.counts["idle_closed"] += 1
                conn.close_with(ErrorCode.IDLE_TIMEOUT, f"nothing received for {self.cfg.idle_timeout:g} s")
        self.limiter.sweep()

    def render_metrics(self) -> str:
        m, out = self.metrics, []

        def metric(name: str, kind: str, help: str, samples) -> None:
            out.append(f"# HELP kit_relay_{name} {help}\n# TYPE kit_relay_{name} {kind}\n")
            for labels, value in samples:
                out.append(f"kit_relay_{name}{labels} {value}\n")

        c = m.counts
        metric("sessions", "gauge", "Sessions with at least one stage connected or frames waiting.",
               [("", len(self.sessions))])
        metric("connections", "gauge", "Authenticated connections.",
               [("", sum(1 for x in self.conns if x.state == "open"))])
        metric("pending_handshakes", "gauge", "Connections that have not finished the handshake.",
               [("", sum(self.pending.values()))])
        metric("queued_bytes", "gauge", "Bytes of frames waiting for a stage to connect.", [("", self.queued_total)])
        for name, help in (("accepted", "TCP (or TLS) connections accepted."),
                           ("hello", "HELLO frames received (handshakes started)."),
                           ("auth_success", "Successful authentications."),
                           ("auth_failures", "Handshakes that failed: wrong proof, timeout, or broken frames."),
                           ("refused", "Connections refused by the per-address limits."),
                           ("replaced", "Connections replaced by a reconnect of the same stage."),
                           ("idle_closed", "Connections closed for idleness."),
                           ("stage_unavailable", "Frames answered with a stage_unavailable ERROR.")):
            metric(f"{name}_total", "counter", help, [("", c[name])])
        metric("protocol_errors_total", "counter", "Connections closed for breaking the protocol, by code.",
               [(f'{{code="{k}"}}', v) for k, v in sorted(m.errors.items())])
        metric("frames_total", "counter", "Frames in and out.",
               [('{direction="in"}', m.frames_in), ('{direction="out"}', m.frames_out)])
        metric("bytes_total", "counter", "Frame bytes (header + payload) in and out.",
               [('{direction="in"}', m.bytes_in), ('{direction="out"}', m.bytes_out)])
        cum, samples = 0, []
        for bound, n in zip(LATENCY_BUCKETS + (float("inf"),), m.latency):
            cum += n
            samples.append((f'_bucket{{le="{"+Inf" if bound == float("inf") else f"{bound:g}"}"}}', cum))
        samples += [("_sum", f"{m.latency_sum:.9f}"), ("_count", cum)]
        metric("forward_seconds", "histogram", "Time a frame spends inside the relay: from its last byte read to "
                                               "its hand-off to the destination socket (queueing included).", samples)
        return "".join(out)


class Conn(asyncio.BufferedProtocol):
    """One client connection: handshake state machine, then a frame pump into `Relay.route`."""

    def __init__(self, relay: Relay):
        self.relay = relay
        self.transport = None
        self.peer = self.addr = "?"
        self.state = "new"  # new -> hello -> auth -> open -> closed
        self.limit = MAX_HANDSHAKE_PAYLOAD
        self.head = bytearray()  # a header split across reads
        self.fields: tuple | None = None
        self.frame: bytearray | None = None  # a frame too big for one read, filled in place
        self.filled = 0
        self.name, self.sid, self.stage, self.stages = "", 0, -1, 0
        self.client_nonce = self.server_nonce = b""
        self.session: Session | None = None
        self.write_paused = self.read_paused = False
        self.held: set[Conn] = set()  # senders paused until our write buffer drains
        self.last_rx = time.monotonic()
        self.timer = None
        self.pending = False  # counted in relay.pending until the handshake ends

    # transport callbacks
    def connection_made(self, transport) -> None:
        relay, cfg = self.relay, self.relay.cfg
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername") or ("?", 0)
        self.addr, self.peer = str(peer[0]), f"{peer[0]}:{peer[1]}"
        transport.set_write_buffer_limits(high=cfg.write_buffer)
        relay.conns.add(self)
        relay.metrics.counts["accepted"] += 1
        if relay.closing:
            self.close_with(ErrorCode.SHUTTING_DOWN, "the relay is shutting down")
            return
        reason = ("too many failed handshakes from this address; try later" if relay.limiter.blocked(self.addr)
                  else "too many unfinished handshakes from this address"
                  if relay.pending[self.addr] >= cfg.max_pending_per_addr
                  else "too many connections" if len(relay.conns) > cfg.max_connections else None)
        if reason:
            relay.metrics.counts["refused"] += 1
            log("refused", level="warning", peer=self.peer, reason=reason)
            self.close_with(ErrorCode.RATE_LIMITED, reason)
            return
        self.state, self.pending = "hello", True
        relay.pending[self.addr] += 1
        self.timer = asyncio.get_running_loop().call_later(cfg.handshake_timeout, self.handshake_timeout)

    def connection_lost(self, exc) -> None:
        if self.state != "closed" and self.state != "new":
            log("disconnected", peer=self.peer, session=self.name, stage=self.stage,
                reason=str(exc) if exc else "eof")
        self._closed()
        self.relay.conns.discard(self)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._release()

    def get_buffer(self, sizehint: int):
        if self.frame is not None:
            return memoryview(self.frame)[self.filled:]
        return self.relay.scratch

    def buffer_updated(self, nbytes: int) -> None:
        self.last_rx = time.monotonic()
        if self.state == "closed":
            return
        try:
            if self.frame is None:
                self._consume(self.relay.scratch[:nbytes])
                return
            self.filled += nbytes
            if self.filled == len(self.frame):
                frame, self.frame = self.frame, None
                self._on_frame(self.fields, frame)
        except ProtocolError as e:
            self.fail(e.code, str(e))

    def eof_received(self):
        return None  # close the transport

    # frame pump
    def _consume(self, view: memoryview) -> None:
        pos, end = 0, len(view)
        while pos < end and self.state not in ("closed", "new"):
            start = pos
            if self.head:  # finish a header begun in an earlier read
                take = min(HEADER_LEN - len(self.head), end - pos)
                self.head += view[pos:pos + take]
                pos += take
                if len(self.head) < HEADER_LEN:
                    return
                self.fields = parse_header(self.head, self.limit)
            elif end - pos < HEADER_LEN:
                self.head = bytearray(view[pos:end])
                return
            else:
                self.fields = parse_header(view[pos:pos + HEADER_LEN], self.limit)
                pos += HEADER_LEN
            length = self.fields[6]
            if end - pos >= length:
                buf = (bytes(self.head) + view[pos:pos + length]) if self.head else bytes(view[start:pos + length])
                self.head = bytearray()
                pos += length
                self._on_frame(self.fields, buf)
            else:
                frame = bytearray(HEADER_LEN + length)
                head = self.head or view[start:start + HEADER_LEN]
                frame[:HEADER_LEN] = head
                frame[HEADER_LEN:HEADER_LEN + end - pos] = view[pos:end]
                self.head = bytearray()
                self.frame, self.filled = frame, HEADER_LEN + end - pos
                return

    def _on_frame(self, fields: tuple, buf) -> None:
        t0 = time.perf_counter()
        m = self.relay.metrics
        m.frames_in += 1
        m.bytes_in += len(buf)
        if self.state == "open":
            self.relay.route(self, fields, buf, t0)
        elif self.state == "hello":
            self._on_hello(fields, buf)
        elif self.state == "auth":
            self._on_auth(fields, buf)

    def _on_hello(self, fields: tuple, buf) -> None:
        ftype, _, src, _, session, _, _ = fields
        if ftype != FrameType.HELLO:
            raise ProtocolError(ErrorCode.BAD_STATE, f"expected HELLO, got {ftype.name}")
        self.relay.metrics.counts["hello"] += 1
        name, stages, nonce = decode_hello(memoryview(buf)[HEADER_LEN:])
        if session_id(name) != session:
            raise ProtocolError(ErrorCode.BAD_PAYLOAD, "the header's session id is not the session name's")
        if src >= stages:
            raise ProtocolError(ErrorCode.BAD_ROUTE, f"stage {src} is not in 0..{stages - 1}")
        self.name, self.sid, self.stage, self.stages, self.client_nonce = name, session, src, stages, nonce
        self.server_nonce = secrets.token_bytes(NONCE_LEN)
        self.state = "auth"
        self.send(encode_header(FrameType.CHALLENGE, RELAY, src, 0, 0, session, NONCE_LEN) + self.server_nonce)

    def _on_auth(self, fields: tuple, buf) -> None:
        ftype, _, src, _, session, _, _ = fields
        if ftype != FrameType.AUTH or src != self.stage or session != self.sid:
            raise ProtocolError(ErrorCode.BAD_STATE, "expected AUTH for the place named in HELLO")
        relay, token = self.relay, self.relay.cfg.token
        args = (self.client_nonce, self.server_nonce, self.name, self.stage, self.stages)
        if not hmac.compare_digest(bytes(memoryview(buf)[HEADER_LEN:]), auth_mac(token, "node", *args)):
            relay.metrics.counts["auth_failures"] += 1
            relay.limiter.fail(self.addr)
            log("auth_failed", level="warning", peer=self.peer, session=self.name, stage=self.stage)
            self.close_with(ErrorCode.AUTH_FAILED, "authentication failed")
            return
        self._leave_pending()
        self.timer.cancel()
        self.state = "open"
        self.limit = relay.cfg.max_payload
        relay.metrics.counts["auth_success"] += 1
        replaced = relay.register(self)
        cfg = relay.cfg
        welcome = auth_mac(token, "relay", *args) + encode_control({
            "version": VERSION, "max_payload": cfg.max_payload, "idle_timeout": cfg.idle_timeout,
            "stage_wait": cfg.stage_wait, "replaced": replaced})
        self.send(encode_header(FrameType.WELCOME, RELAY, self.stage, 0, 0, self.sid, len(welcome)) + welcome)
        log("stage_up", session=self.name, stage=self.stage, stages=self.stages, peer=self.peer, replaced=replaced)
        relay.flush(self)

    # output
    def write(self, buf, t0: float) -> None:
        """Forward a whole frame (header + payload) as received."""
        self.transport.write(buf)
        m = self.relay.metrics
        m.frames_out += 1
        m.bytes_out += len(buf)
        m.observe(time.perf_counter() - t0)

    def send(self, data: bytes) -> None:
        if self.state != "closed" and not self.transport.is_closing():
            self.transport.write(data)

    def send_error(self, code: ErrorCode, message: str, round_id: int = 0, **extra) -> None:
        payload = encode_error(code, message, **extra)
        dst = self.stage if self.stage >= 0 else RELAY
        self.send(encode_header(FrameType.ERROR, RELAY, dst, round_id, 0, self.sid, len(payload)) + payload)

    def hold(self, sender: Conn) -> None:
        """Backpressure: stop reading from `sender` until our write buffer drains."""
        if not sender.read_paused and sender.state == "open":
            sender.read_paused = True
            sender.transport.pause_reading()
            self.held.add(sender)

    def _release(self) -> None:
        held, self.held = self.held, set()
        for sender in held:
            if sender.read_paused and sender.state == "open":
                sender.read_paused = False
                sender.transport.resume_reading()

    # endings
    def handshake_timeout(self) -> None:
        if self.state in ("hello", "auth"):
            self.relay.metrics.counts["auth_failures"] += 1
            self.relay.limiter.fail(self.addr)
            self.close_with(ErrorCode.HANDSHAKE_TIMEOUT,
                            f"handshake not finished within {self.relay.cfg.handshake_timeout:g} s")

    def fail(self, code: ErrorCode, message: str) -> None:
        """Close this connection only, for breaking the protocol."""
        relay = self.relay
        relay.metrics.errors[code.name.lower()] += 1
        if self.state in ("hello", "auth"):
            relay.metrics.counts["auth_failures"] += 1
            relay.limiter.fail(self.addr)
        self.close_with(code, message)

    def close_with(self, code: ErrorCode | None, message: str) -> None:
        """Say why (an ERROR frame, or BYE), then close after the buffered bytes are out (at most 2 s)."""
        if self.state == "closed":
            return
        if code is not None:
            log("close", level="warning" if code != ErrorCode.SHUTTING_DOWN else "info", peer=self.peer,
                session=self.name, stage=self.stage, code=code.name.lower(), reason=message)
            self.send_error(code, message)
        elif message != "bye":
            payload = encode_control({"reason": message})
            self.send(encode_header(FrameType.BYE, RELAY, self.stage, 0, 0, self.sid, len(payload)) + payload)
        else:
            log("bye", peer=self.peer, session=self.name, stage=self.stage)
        self._closed()
        loop = asyncio.get_running_loop()
        if self.transport.can_write_eof():
            # FIN after the queued bytes, then read and drop for a moment: closing with unread input would send
            # a RST, and a RST can destroy the ERROR frame before the peer reads it.
            self.transport.write_eof()
            loop.call_later(1.0, self.transport.close)
        else:
            self.transport.close()
        loop.call_later(2.0, self.transport.abort)

    def _closed(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self._leave_pending()
        self.state = "closed"
        self.frame = None
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        self.relay.unregister(self)
        self._release()

    def _leave_pending(self) -> None:
        if self.pending:
            self.pending = False
            pending = self.relay.pending
            pending[self.addr] -= 1
            if pending[self.addr] <= 0:
                del pending[self.addr]


async def serve_metrics(relay: Relay, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Minimal HTTP/1.1: GET /healthz and GET /metrics, one request per connection."""
    try:
        request = await asyncio.wait_for(reader.readline(), 5)
        for _ in range(100):
            line = await asyncio.wait_for(reader.readline(), 5)
            if line in (b"\r\n", b"\n", b""):
                break
        parts = request.decode("latin-1").split()
        path = parts[1].split("?")[0] if len(parts) >= 2 else ""
        if path == "/healthz":
            status, body, ctype = "200 OK", b"ok\n", "text/plain"
        elif path == "/metrics":
            status, body, ctype = "200 OK", relay.render_metrics().encode(), "text/plain; version=0.0.4"
        else:
            status, body, ctype = "404 Not Found", b"not found; try /healthz or /metrics\n", "text/plain"
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + body)
        await writer.drain()
    except (asyncio.TimeoutError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


def tls_context(cert: str, key: str) -> tuple:
    """Server TLS context and the certificate's pinned fingerprint."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    with open(cert) as f:
        pem = f.read()
    end = pem.index(ssl.PEM_FOOTER) + len(ssl.PEM_FOOTER)
    first = pem[pem.index(ssl.PEM_HEADER):end]
    return ctx, fingerprint_of_der(ssl.PEM_cert_to_DER_cert(first))


async def serve(cfg: Config, ctx: ssl.SSLContext | None = None, fingerprint: str = "") -> None:
    """Run until SIGTERM or SIGINT, then tell every stage goodbye and return."""
    loop = asyncio.get_running_loop()
    relay = Relay(cfg)
    loop.set_exception_handler(lambda _loop, c: log("loop_error", level="warning", message=c.get("message"),
                                                    error=repr(c.get("exception"))))
    server = await loop.create_server(lambda: Conn(relay), cfg.host, cfg.port, ssl=ctx, backlog=1024,
                                      ssl_handshake_timeout=cfg.handshake_timeout if ctx else None)
    metrics = None
    if cfg.metrics_port:
        metrics = await asyncio.start_server(lambda r, w: serve_metrics(relay, r, w), cfg.metrics_host,
                                             cfg.metrics_port)
    port = server.sockets[0].getsockname()[1]
    log("listening", host=cfg.host, port=port, tls=ctx is not None, fingerprint=fingerprint or "none",
        metrics=f"{cfg.metrics_host}:{metrics.sockets[0].getsockname()[1]}" if metrics else "off",
        protocol=VERSION, max_payload=cfg.max_payload)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tick = min(0.25, cfg.stage_wait / 4, cfg.idle_timeout / 4)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), tick)
        except asyncio.TimeoutError:
            relay.sweep()
    log("shutdown", connections=len(relay.conns), sessions=len(relay.sessions))
    relay.closing = True
    server.close()
    for conn in list(relay.conns):
        if conn.state == "open":
            conn.close_with(None, "the relay is shutting down")
        else:
            conn.close_with(ErrorCode.SHUTTING_DOWN, "the relay is shutting down")
    deadline = loop.time() + 2.0
    while relay.conns and loop.time() < deadline:
        await asyncio.sleep(0.02)
    if metrics:
        metrics.close()
    log("stopped")
