"""Node side of the relay link: pinned TLS, the token handshake, frames in and out, reconnects, pings.

Blocking sockets and one reader thread, because the node runtime is threaded. The reader answers PINGs,
keeps the link alive with heartbeats and redials when the link breaks; while a caller waits in `recv`, that
caller reads the socket itself (one thread woken per frame instead of two); `send` waits for that redial and
sends again, so a relay restart costs the caller a pause, not an error. `reconnects` tells the runtime to
resend its in-flight round (frames inside the broken link may be lost; rounds are idempotent).
"""
from __future__ import annotations

import contextlib
import os
import queue
import random
import select
import socket
import ssl
import threading
import time

from relay.protocol import (HEADER_LEN, MAX_PAYLOAD, NONCE_LEN, RELAY, AuthError, ErrorCode, Frame, FrameType,
                            ProtocolError, clean_token, client_handshake, decode_error, encode_header, encode_hello,
                            normalize_fingerprint, parse_header, pinned_tls_wrap, session_id)

RETRYABLE = (ErrorCode.RATE_LIMITED, ErrorCode.SHUTTING_DOWN, ErrorCode.HANDSHAKE_TIMEOUT)
_LOST = object()  # inbox marker: the link is gone for good
SPIN_MAX_S = 0.01  # a wait that spins blocks again after this long: a wrong guess of the arrival costs only this


class ConnectionLost(ConnectionError):
    """The relay stayed unreachable past the reconnect deadline, the stage was taken over, or the client closed."""


def parse_address(address: str) -> tuple:
    """"host:port" or "[v6]:port" -> (host, port)."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"relay address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def _wait_input(wire: _Wire, wait: float, spin: tuple[float, float] | None) -> bool:
    """Whether input came within `wait` s; polled without sleeping inside the `spin` window."""
    now = time.perf_counter()
    end = now + wait
    if spin is None or now >= spin[1]:
        return bool(wire.wait_readable(wait))
    if now < spin[0] and wire.wait_readable(min(wait, spin[0] - now)):
        return True
    while (now := time.perf_counter()) < min(end, spin[1]):
        if wire.wait_readable(0):
            return True
    return now < end and bool(wire.wait_readable(end - now))


class _Wire:
    """One authenticated socket. Plain TCP: blocking, read and written from different threads at once.
    TLS: an OpenSSL connection must not be used by two threads at once, so the socket is non-blocking,
    each SSL call holds `lock`, and waiting for the socket happens outside it."""

    def __init__(self, sock, tls: bool, stall: float):
        self.sock, self.tls, self.stall = sock, tls, stall
        self.lock = threading.Lock()
        self.fd = sock.fileno()
        self._polls = threading.local()  # the reader thread and recv() both wait for input: one poll object each
        if tls:
            sock.setblocking(False)
        else:
            sock.settimeout(stall)

    def send(self, parts: list) -> None:
        if not self.tls:
            views = [memoryview(p).cast("B") for p in parts if len(p)]
            while views:
                n = self.sock.sendmsg(views)
                while n:
                    if n >= len(views[0]):
                        n -= len(views.pop(0))
                    else:
                        views[0], n = views[0][n:], 0
            return
        view = memoryview(b"".join(parts))
        deadline = time.monotonic() + self.stall
        while view:
            with self.lock:
                try:
                    view = view[self.sock.send(view):]
                    continue
                except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
                    pass
            self._wait(select.POLLOUT, deadline)

    def wait_readable(self, timeout: float, nudge: int | None = None) -> bool | None:
        """True when input is waiting, False after `timeout`, None when the `nudge` fd is readable first
        (it is drained)."""
        if self.tls:
            with self.lock:
                if self.sock.pending():
                    return True
        poll = getattr(self._polls, "poll", None)
        if poll is None:
            poll = self._polls.poll = select.poll()
            poll.register(self.fd, select.POLLIN)
            if nudge is not None:
                poll.register(nudge, select.POLLIN)
        ready = {fd for fd, _ in poll.poll(timeout * 1000)}
        if self.fd in ready:
            return True
        if nudge in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(nudge, 4096)
            return None
        return False

    def recv_exact(self, view: memoryview) -> None:
        deadline = time.monotonic() + self.stall
        while view:
            if self.tls:
                with self.lock:
                    try:
                        n = self.sock.recv_into(view)
                    except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                        n = -1
                if n < 0:
                    self._wait(select.POLLIN, deadline)
                    continue
            else:
                n = self.sock.recv_into(view)
            if n == 0:
                raise ConnectionError("the relay closed the connection")
            view = view[n:]

    def _wait(self, event: int, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout(f"the relay link stalled for {self.stall:g} s")
        p = select.poll()
        p.register(self.sock.fileno(), event)
        p.poll(min(left, 0.5) * 1000)

    def shutdown(self) -> None:
        """Break the link so that a thread blocked on it wakes up."""
        with self.lock if self.tls else contextlib.nullcontext():
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.shutdown()
        with self.lock if self.tls else contextlib.nullcontext():
            self.sock.close()


class RelayClient:
    """A stage's link to the relay. `send` is thread-safe; `recv` is meant for one consumer thread."""

    def __init__(self, address: str, session: str, stage: int, stages: int, token: bytes | str,
                 fingerprint: str | None = None, *, connect_timeout: float = 10.0, reconnect_deadline: float = 60.0,
                 spin_s: float = 0.0):
        self.address = address
        self.spin_s = spin_s  # recv(due=...) polls without sleeping from this long before a frame is due
        self.host, self.port = parse_address(address)
        if not 0 <= stage < stages:
            raise ValueError(f"stage {stage} is not in 0..{stages - 1}")
        encode_hello(session, stages, bytes(NONCE_LEN))  # checks the name and stage count now, not at connect
        self.session, self.stage, self.stages = session, stage, stages
        self.sid = session_id(session)
        self._token = clean_token(token)
        self.fingerprint = normalize_fingerprint(fingerprint) if fingerprint else None
        self.connect_timeout, self.reconnect_deadline = connect_timeout, reconnect_deadline
        self.reconnects = 0
        self.bytes_sent = self.bytes_received = 0
        self.welcome: dict = {}
        self._wire: _Wire | None = None
        self._gen = 0  # bumped on every new link
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        # whoever holds it reads the socket: the reader thread, or recv() while its caller waits for a frame
        self._read_lock = threading.Lock()
        self._broken: _Wire | None = None  # a link recv() saw break: the reader thread redials it
        # recv() reading: the reader thread stays off the socket (nudged out of its poll), so that a frame
        # wakes one thread, not two that then queue for the GIL
        self._park = threading.Condition()
        self._caller_reading = False
        self._nudge_r, self._nudge_w = os.pipe()
        os.set_blocking(self._nudge_r, False)
        os.set_blocking(self._nudge_w, False)
        self._inbox: queue.Queue = queue.Queue()
        self._pings: dict = {}  # ping payload -> [event, receive time]
        self._lost: ConnectionLost | None = None
        self._closing = False
        self._reader: threading.Thread | None = None
        self._last_rx = time.monotonic()
        self._heartbeat = 5.0

    def __repr__(self) -> str:
        return f"RelayClient({self.address}, session={self.session!r}, stage={self.stage}/{self.stages})"

    def __enter__(self) -> RelayClient:
        if self._reader is None:
            self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # connecting
    def connect(self) -> None:
        """TLS (iff a fingerprint is pinned, checked before anything is sent), then the handshake; retried with
        exponential backoff until `reconnect_deadline`. Wrong token or certificate fail at once."""
        if self._reader is not None:
            raise RuntimeError("already connected")
        self._wire = self._dial_until(time.monotonic() + self.reconnect_deadline)
        self._reader = threading.Thread(target=self._read_loop, name=f"relay-reader-{self.stage}", daemon=True)
        self._reader.start()

    def _dial(self) -> _Wire:
        sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.fingerprint:
                sock = pinned_tls_wrap(sock, self.fingerprint)
            welcome = client_handshake(sock, self.session, self.stage, self.stages, self._token)
        except BaseException:
            sock.close()
            raise
        self.welcome = welcome
        idle = float(welcome.get("idle_timeout", 30.0))
        self._heartbeat = max(0.2, min(5.0, idle / 4))
        self._last_rx = time.monotonic()
        return _Wire(sock, self.fingerprint is not None, stall=idle)

    def _dial_until(self, deadline: float) -> _Wire:
        delay = 0.1
        while True:
            if self._closing:
                raise ConnectionLost("the client was closed")
            try:
                return self._dial()
            except AuthError as e:
                if e.code not in RETRYABLE:
                    raise
                err: Exception = e
            except (OSError, ProtocolError) as e:
                err = e
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConnectionLost(f"cannot reach the relay at {self.address} within {self.reconnect_deadline:g} s: "
                                     f"{err}") from err
            time.sleep(min(left, random.uniform(delay / 2, delay)))
            delay = min(delay * 2, 5.0)

    # sending
    def send(self, dst: int, type: FrameType, payload: bytes = b"", round_id: int = 0, flags: int = 0) -> None:
        """Send one frame to stage `dst` (or RELAY). If the link is broken, wait for the reader to redial and
        send again on the new link; ConnectionLost after the reconnect deadline."""
        size = len(memoryview(payload).cast("B"))
        limit = self.welcome.get("max_payload", MAX_PAYLOAD)
        if size > limit:
            raise ValueError(f"payload of {size} bytes is over the relay's limit of {limit}")
        header = encode_header(type, self.stage, dst, round_id, flags, self.sid, size)
        while True:
            wire, gen = self._current()
            try:
                with self._send_lock:
                    wire.send([header, payload])
                    self.bytes_sent += HEADER_LEN + size
                return
            except (OSError, ValueError):
                wire.shutdown()  # make sure the reader sees it and redials
                with self._cond:
                    self._cond.wait_for(lambda: self._gen != gen or self._lost is not None,
                                        timeout=self.reconnect_deadline + self.connect_timeout + 5)

    def _current(self) -> tuple:
        with self._cond:
            if self._lost is not None:
                raise self._lost
            if self._wire is None:
                raise RuntimeError("connect() first")
            return self._wire, self._gen

    def _send_nowait(self, wire: _Wire, frame_type: FrameType, dst: int, payload: bytes, round_id: int = 0) -> None:
        """Reader-thread sends (PONG, heartbeat): never block the reader for long behind a stalled send."""
        if self._send_lock.acquire(timeout=self._heartbeat):
            try:
                wire.send([encode_header(frame_type, self.stage, dst, round_id, 0, self.sid, len(payload)), payload])
                self.bytes_sent += HEADER_LEN + len(payload)
            except (OSError, ValueError):
                wire.shutdown()
            finally:
                self._send_lock.release()

    # receiving
    def recv(self, timeout: float | None = None, due: float | None = None) -> Frame | None:
        """Next TENSOR/TOKENS/CONTROL/ERROR (or a peer's BYE) frame; None on timeout. Links that break while
        waiting are redialed underneath; ConnectionLost once that fails.

        While it waits, the calling thread reads the socket itself when the reader thread is not in the
        middle of a frame: a frame then costs one thread wake-up, not the reader's and then this thread's.
        With `due` (the time.perf_counter() instant the frame is expected at) and `spin_s`, it polls the
        socket without sleeping from spin_s before then, for at most SPIN_MAX_S: a thread that slept through
        a round's ~90 ms wait picks the frame up late (bench/NOTES.md, "Waiting awake")."""
        deadline = None if timeout is None else time.monotonic() + timeout
        spin = None if due is None or self.spin_s <= 0 else (due - self.spin_s, due - self.spin_s + SPIN_MAX_S)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                item = self._read_for_caller(self._heartbeat if left is None else min(left, self._heartbeat), spin)
                if item is None:
                    continue
            if item is _LOST:
                self._inbox.put(_LOST)
                raise self._lost
            return item

    def pending(self) -> bool:
        """Whether a frame for recv() is already waiting (the reader thread queued it)."""
        return not self._inbox.empty()

    def _read_for_caller(self, wait: float, spin: tuple[float, float] | None = None) -> Frame | object | None:
        """Up to `wait` s: a frame read here (or queued by the reader thread), or None. Inside the `spin`
        window (perf_counter instants) the socket is polled without sleeping."""
        wire = self._wire
        if wire is None or wire is self._broken or self._lost is not None:
            try:  # the reader thread is redialing, or gone: it queues what comes
                return self._inbox.get(timeout=min(wait, 0.05))
            except queue.Empty:
                return None
        with self._park:
            self._caller_reading = True
        with contextlib.suppress(BlockingIOError):
            os.write(self._nudge_w, b"x")
        try:
            with self._read_lock:  # the reader thread holds it only while it reads a frame
                if not self._inbox.empty() or not _wait_input(wire, wait, spin):
                    return None  # a frame the reader queued before this thread took over goes first
                frame = self._read_frame(wire)
                return frame if self._dispatch(wire, frame, queue_it=False) else None
        except (OSError, ValueError, ProtocolError):
            self._broken = wire
            wire.shutdown()  # the reader thread sees it too and redials
            return None
        finally:
            with self._park:
                self._caller_reading = False
                self._park.notify_all()

    def ping(self, timeout: float = 5.0, dst: int = RELAY) -> float:
        """Round trip in ms to the relay (or, with `dst`, to another stage of the session)."""
        token = os.urandom(8)
        entry = self._pings[token] = [threading.Event(), 0.0]
        t0 = time.perf_counter()
        self.send(dst, FrameType.PING, token)
        if not entry[0].wait(timeout):
            self._pings.pop(token, None)
            raise TimeoutError(f"no PONG within {timeout:g} s")
        return (entry[1] - t0) * 1000.0

    def _read_loop(self) -> None:
        try:
            self._read_until_lost()
        except BaseException as e:  # a bug must not leave recv() waiting forever
            self._fail(ConnectionLost(f"the relay reader failed: {e!r}"))
            raise

    def _read_until_lost(self) -> None:
        while True:
            wire, gen = self._wire, self._gen
            try:
                with self._park:
                    off = self._park.wait_for(lambda: not self._caller_reading or self._closing, self._heartbeat)
                ready = wire.wait_readable(self._heartbeat, nudge=self._nudge_r) if off else False
                if ready is None:
                    continue  # recv() reads now
                if not ready:
                    quiet = time.monotonic() - self._last_rx
                    if quiet > wire.stall:
                        raise ConnectionError(f"nothing from the relay for {quiet:.0f} s")
                    self._send_nowait(wire, FrameType.PING, RELAY, b"")
                    continue
                with self._read_lock:
                    if wire is self._broken:
                        raise ConnectionError("the link broke under recv()")
                    if wire.wait_readable(0):  # else recv() has read it
                        self._dispatch(wire, self._read_frame(wire))
            except (OSError, ValueError, ProtocolError) as e:
                wire.close()
                if self._closing or self._lost is not None:
                    return
                if not self._redial(gen, e):
                    return

    def _read_frame(self, wire: _Wire) -> Frame:
        head = bytearray(HEADER_LEN)
        wire.recv_exact(memoryview(head))
        fields = parse_header(head)
        payload = bytearray(fields[6])
        wire.recv_exact(memoryview(payload))
        self._last_rx = time.monotonic()
        self.bytes_received += HEADER_LEN + len(payload)
        ftype, flags, src, dst, session, round_id, _ = fields
        return Frame(ftype, src, dst, round_id, flags, payload, session, received=time.perf_counter())

    def _dispatch(self, wire: _Wire, frame: Frame, queue_it: bool = True) -> bool:
        """Answer or consume link frames (PING, PONG, the relay's BYE and link errors); True for a frame meant
        for recv()'s caller, which goes to the inbox if `queue_it`."""
        t, from_relay = frame.type, frame.src == RELAY
        if t == FrameType.PING:
            self._send_nowait(wire, FrameType.PONG, frame.src, bytes(frame.payload), frame.round_id)
        elif t == FrameType.PONG:
            entry = self._pings.pop(bytes(frame.payload), None)
            if entry is not None:
                entry[1] = time.perf_counter()
                entry[0].set()
        elif t == FrameType.BYE and from_relay:
            raise ConnectionError("the relay said goodbye (restarting?)")
        elif t == FrameType.ERROR and from_relay and self._relay_error(frame):
            return False
        elif t in (FrameType.TENSOR, FrameType.TOKENS, FrameType.CONTROL, FrameType.ERROR, FrameType.BYE):
            if queue_it:
                self._inbox.put(frame)
            return True
        return False

    def _relay_error(self, frame: Frame) -> bool:
        """Handle the relay's errors about the link itself; True if consumed."""
        try:
            err = decode_error(frame.payload)
        except ProtocolError:
            return False
        if err["code"] == ErrorCode.REPLACED:
            self._fail(ConnectionLost(f"stage {self.stage} of session {self.session!r} was taken over by another "
                                      "connection"))
            raise ConnectionError("replaced")
        return err["code"] in (ErrorCode.IDLE_TIMEOUT, ErrorCode.SHUTTING_DOWN)

    def _redial(self, gen: int, cause: Exception) -> bool:
        """Dial again after the link broke (`cause`); False once the deadline passes or the relay refuses, and
        recv()/send() then raise ConnectionLost naming both what broke the link and why it stayed broken."""
        try:
            wire = self._dial_until(time.monotonic() + self.reconnect_deadline)
        except (ConnectionLost, AuthError) as e:
            why = str(e) if isinstance(e, ConnectionLost) else f"reconnect refused: {e}"
            lost = ConnectionLost(f"the link to the relay broke ({cause or type(cause).__name__}); {why}")
            lost.__cause__ = e
            self._fail(lost)
            return False
        with self._cond:
            if self._closing:
                wire.close()
                return False
            self._wire = wire
            self._gen = gen + 1
            self.reconnects += 1
            self._cond.notify_all()
        return True

    def _fail(self, err: ConnectionLost) -> None:
        with self._cond:
            if self._lost is None:
                self._lost = err
                self._inbox.put(_LOST)
            self._cond.notify_all()

    def close(self) -> None:
        """Say BYE to the relay and close; later send/recv raise ConnectionLost."""
        self._closing = True
        wire = self._wire
        if wire is not None and self._lost is None:
            self._send_nowait(wire, FrameType.BYE, RELAY, b"")
            wire.close()
        self._fail(ConnectionLost("the client was closed"))
        if self._reader is not None and self._reader is not threading.current_thread():
            with self._park:
                self._park.notify_all()
            self._reader.join(timeout=5)
        if self._nudge_w >= 0 and not (self._reader and self._reader.is_alive()):
            os.close(self._nudge_r)
            os.close(self._nudge_w)
            self._nudge_r = self._nudge_w = -1
