"""WAN emulator: a TCP proxy that adds one-way delay, jitter and a bandwidth cap, and cuts on command.

On Kaggle every stage sits behind NAT and dials out to the relay across the internet. Locally,
`kit run --rtt-ms R` puts one emulator between each stage process and the relay, so every
stage <-> relay hop is an emulated WAN link:

    node0 --[wan]-- relay --[wan]-- node1

Convention for `--rtt-ms R`: a round trip node0 -> relay -> node1 -> relay -> node0 crosses
4 emulated links (each stage's link twice), so each link gets R/4 one way
(`per_link_delay_ms`). The network part of a round then costs R, as on the real ring.
`--jitter-ms` and `--bandwidth-mbit` apply per link and per direction as given.

Link model, per direction: a chunk read at time t is serialized after the previous one
(start = max(t, link_free), link_free = start + bits / bandwidth), then propagates for
delay + jitter, and is released at max(that, previous release), so bytes are never reordered.
Jitter is uniform in [0, J] ms, from a generator seeded by --seed, the connection number and
the direction. EOF travels through the same queue, so a half-close arrives after the data.

SIGUSR1 (or `WanEmulator.cut_all()`) aborts every proxied connection on both sides with RST
(SO_LINGER 0) and keeps listening, so reconnection and replay can be tested.

    python -m kit.wan --listen 127.0.0.1:0 --upstream 127.0.0.1:7000 --delay-ms 20 --ready-file port.txt
"""

import argparse
import collections
import errno
import logging
import os
import random
import selectors
import signal
import socket
import struct
import sys
import threading
import time

CHUNK = 64 * 1024
SPIN_S = 0.0003  # within this of a release the loop polls instead of sleeping: a sleep can wake ~0.1 ms late
QUEUE_CHUNKS = 256  # per direction: at most 16 MiB waiting inside the emulator, then TCP backpressure

log = logging.getLogger("kit.wan")


def per_link_delay_ms(rtt_ms: float) -> float:
    """One-way delay per emulated link for `kit run --rtt-ms`: the ring round trip crosses 4 links."""
    return rtt_ms / 4.0


class _Link:
    """Release times of one direction: serialization at the bandwidth, then delay + jitter, FIFO."""

    def __init__(self, delay_ms: float, jitter_ms: float, bandwidth_mbit: float | None, rng: random.Random):
        self.delay_s = delay_ms / 1e3
        self.jitter_s = jitter_ms / 1e3
        self.bytes_per_s = bandwidth_mbit * 1e6 / 8 if bandwidth_mbit else None
        self.rng = rng
        self.free = 0.0  # when the serializer is idle again
        self.last = 0.0  # previous release time

    def release_time(self, now: float, nbytes: int) -> float:
        self.free = max(now, self.free)
        if self.bytes_per_s:
            self.free += nbytes / self.bytes_per_s
        jitter = self.rng.uniform(0.0, self.jitter_s) if self.jitter_s else 0.0
        self.last = max(self.free + self.delay_s + jitter, self.last)
        return self.last


class _Way:
    """One direction of a connection: chunks read from `src` wait in `queue` for their release to `dst`."""

    def __init__(self, src: socket.socket, dst: socket.socket, link: _Link, name: str):
        self.src, self.dst, self.link, self.name = src, dst, link, name
        self.queue: collections.deque[tuple[float, bytes | None]] = collections.deque()  # None: EOF
        self.unsent = b""  # released, not yet taken by dst's socket buffer
        self.read_eof = False
        self.done = False  # EOF delivered
        self.bytes = 0

    def wants_read(self) -> bool:
        return not self.read_eof and len(self.queue) < QUEUE_CHUNKS


class _Conn:
    def __init__(self, n: int, client: socket.socket, upstream: socket.socket, peer: str):
        self.n, self.client, self.upstream, self.peer = n, client, upstream, peer
        self.connected = False  # upstream connect() finished
        self.ways: list[_Way] = []

    @property
    def up(self) -> int:
        return self.ways[0].bytes if self.ways else 0

    @property
    def down(self) -> int:
        return self.ways[1].bytes if self.ways else 0


def _abort(sock: socket.socket) -> None:
    """Close with RST: SO_LINGER 0 makes close() drop the connection instead of a graceful FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class WanEmulator:
    """One emulated WAN link in front of `upstream`: one thread, one selector, no per-chunk task switches.

    A chunk is read as soon as the selector reports it and written at its release time (the loop polls
    instead of sleeping for the last SPIN_S before a release, or always with `spin`), so each hop adds
    what the emulated link says and little else. `start()` serves from a background thread;
    `serve_forever()` from the calling one. Counters: `connections_cut` (by cut_all), `bytes_up`
    (client -> upstream) and `bytes_down` (upstream -> client), counting bytes delivered out of the emulator.
    """

    def __init__(self, upstream_host: str, upstream_port: int, *, listen_host: str = "127.0.0.1",
                 listen_port: int = 0, delay_ms: float = 0.0, jitter_ms: float = 0.0,
                 bandwidth_mbit: float | None = None, seed: int | None = None, spin: bool = False):
        self.upstream = (upstream_host, upstream_port)
        self.listen_host, self.port = listen_host, listen_port
        self.delay_ms, self.jitter_ms, self.bandwidth_mbit, self.seed = delay_ms, jitter_ms, bandwidth_mbit, seed
        self.spin = spin
        self.connections_cut = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self._sel = selectors.SelectSelector()  # select() sleeps to the microsecond; epoll rounds up to a ms
        self._listener: socket.socket | None = None
        self._conns: dict[socket.socket, _Conn] = {}  # both sockets of each connection
        self._count = 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._requests: collections.deque[tuple[str, threading.Event | None, list]] = collections.deque()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop_ident: int | None = None
        self._family: int | None = None
        self._upstream_addr: tuple | None = None

    def listen(self) -> int:
        """Bind and listen; returns the actual port (listen_port 0 picks a free one)."""
        family = socket.AF_INET6 if ":" in self.listen_host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((self.listen_host, self.port))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        return self.port

    def resolve(self) -> None:
        """Look the upstream up once (raises socket.gaierror): every connection then dials the same address."""
        family, _, _, _, addr = socket.getaddrinfo(*self.upstream, type=socket.SOCK_STREAM)[0]
        self._family, self._upstream_addr = family, addr

    def start(self) -> int:
        """Listen and serve from a background thread; returns the actual port."""
        self.resolve()
        port = self.listen()
        self._thread = threading.Thread(target=self.serve_forever, name=f"wan:{port}", daemon=True)
        self._thread.start()
        return port

    def serve_forever(self) -> None:
        """Run the loop in this thread until close() or stop()."""
        self._loop_ident = threading.get_ident()
        try:
            while not self._stopping:
                self._turn()
        finally:
            self._shutdown()

    def cut_all(self) -> int:
        """Abort every proxied connection on both sides (RST); keep listening. Returns how many."""
        return self._ask("cut")

    def stop(self) -> None:
        """Ask the loop to close every connection (FIN) and return; safe from a signal handler."""
        self._post("stop", None, [])

    def close(self) -> None:
        """Stop listening and close every connection (FIN; data still waiting in the link is dropped)."""
        self.stop()
        if self._thread is not None:
            self._thread.join(10)

    def request_cut(self) -> None:
        """cut_all() without waiting for it: for a signal handler."""
        self._post("cut", None, [])

    def _ask(self, what: str) -> int:
        if threading.get_ident() == self._loop_ident or self._thread is None and self._loop_ident is None:
            return self._do(what)
        done, result = threading.Event(), []
        self._post(what, done, result)
        if not done.wait(10):
            raise TimeoutError(f"wan:{self.port}: the loop did not answer {what!r}")
        return result[0]

    def _post(self, what: str, done: threading.Event | None, result: list) -> None:
        self._requests.append((what, done, result))
        try:
            self._wake_w.send(b"x")
        except OSError:  # buffer full (a wake-up is pending anyway) or closed
            pass

    def _do(self, what: str) -> int:
        if what == "stop":
            self._stopping = True
            return 0
        conns = sorted({id(c): c for c in self._conns.values()}.values(), key=lambda c: c.n)
        for conn in conns:
            self._end(conn, abort=True)
            log.info("wan:%d cut #%d up=%d down=%d", self.port, conn.n, conn.up, conn.down)
        self.connections_cut += len(conns)
        return len(conns)

    def _turn(self) -> None:
        due = min((w.queue[0][0] for c in self._live() for w in c.ways if w.queue and not w.unsent), default=None)
        if self.spin:
            timeout = 0.0
        elif due is None:
            timeout = None
        else:
            timeout = max(0.0, due - time.perf_counter() - SPIN_S)
        for key, mask in self._sel.select(timeout):
            sock = key.fileobj
            if sock is self._listener:
                self._accept()
            elif sock is self._wake_r:
                self._serve_requests()
            elif sock in self._conns:
                self._ready(self._conns[sock], sock, mask)
        now = time.perf_counter()
        for conn in self._live():
            for way in conn.ways:
                if way.queue and not way.unsent and way.queue[0][0] <= now:
                    self._deliver(conn, way)

    def _live(self) -> list[_Conn]:
        return list({id(c): c for c in self._conns.values()}.values())

    def _serve_requests(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while self._requests:
            what, done, result = self._requests.popleft()
            result.append(self._do(what))
            if done is not None:
                done.set()

    def _accept(self) -> None:
        try:
            client, addr = self._listener.accept()
        except BlockingIOError:
            return
        self._count += 1
        n = self._count
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "?"
        client.setblocking(False)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        upstream = socket.socket(self._family, socket.SOCK_STREAM)
        upstream.setblocking(False)
        err = upstream.connect_ex(self._upstream_addr)
        conn = _Conn(n, client, upstream, peer)
        self._conns[client] = self._conns[upstream] = conn
        if err not in (0, errno.EINPROGRESS):
            self._unreachable(conn, os.strerror(err))
            return
        self._sel.register(upstream, selectors.EVENT_WRITE)  # connect() done when writable

    def _unreachable(self, conn: _Conn, why: str) -> None:
        log.warning("wan:%d #%d from %s: upstream %s:%d unreachable: %s", self.port, conn.n, conn.peer,
                    *self.upstream, why)
        self._forget(conn)
        _abort(conn.client)
        conn.upstream.close()

    def _ready(self, conn: _Conn, sock: socket.socket, mask: int) -> None:
        if not conn.connected:  # only the upstream is registered until its connect() finishes
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._sel.unregister(sock)
                self._unreachable(conn, os.strerror(err))
                return
            conn.connected = True
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.ways = [_Way(conn.client, conn.upstream, self._link(conn.n, "up"), "up"),
                         _Way(conn.upstream, conn.client, self._link(conn.n, "down"), "down")]
            self._sel.unregister(sock)
            self._sel.register(conn.client, selectors.EVENT_READ)
            self._sel.register(conn.upstream, selectors.EVENT_READ)
            log.info("wan:%d open #%d %s -> %s:%d", self.port, conn.n, conn.peer, *self.upstream)
            return
        try:
            for way in conn.ways:
                if way.src is sock and mask & selectors.EVENT_READ and way.wants_read():
                    data = sock.recv(CHUNK)
                    way.queue.append((way.link.release_time(time.perf_counter(), len(data)), data or None))
                    way.read_eof = not data
                if way.dst is sock and mask & selectors.EVENT_WRITE and way.unsent:
                    self._write(conn, way, way.unsent)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            self._closed(conn, f" reset: {e!r}", abort=True)
            return
        self._interest(conn)

    def _deliver(self, conn: _Conn, way: _Way) -> None:
        _, data = way.queue.popleft()
        try:
            if data is None:
                way.dst.shutdown(socket.SHUT_WR)
                way.done = True
                if all(w.done for w in conn.ways):
                    self._closed(conn, "", abort=False)
                    return
            else:
                self._write(conn, way, data)
        except OSError as e:
            self._closed(conn, f" reset: {e!r}", abort=True)
            return
        self._interest(conn)

    def _write(self, conn: _Conn, way: _Way, data: bytes) -> None:
        try:
            sent = way.dst.send(data)
        except BlockingIOError:
            sent = 0
        way.unsent = data[sent:]
        way.bytes += sent
        if way.name == "up":
            self.bytes_up += sent
        else:
            self.bytes_down += sent

    def _interest(self, conn: _Conn) -> None:
        for sock in (conn.client, conn.upstream):
            mask = 0
            for way in conn.ways:
                if way.src is sock and way.wants_read():
                    mask |= selectors.EVENT_READ
                if way.dst is sock and way.unsent:
                    mask |= selectors.EVENT_WRITE
            try:
                key = self._sel.get_key(sock)
            except KeyError:
                key = None
            if key is None and mask:
                self._sel.register(sock, mask)
            elif key is not None and not mask:
                self._sel.unregister(sock)
            elif key is not None and key.events != mask:
                self._sel.modify(sock, mask)

    def _forget(self, conn: _Conn) -> None:
        for sock in (conn.client, conn.upstream):
            self._conns.pop(sock, None)
            try:
                self._sel.unregister(sock)
            except (KeyError, ValueError):
                pass

    def _end(self, conn: _Conn, abort: bool) -> None:
        self._forget(conn)
        for sock in (conn.client, conn.upstream):
            if abort:
                _abort(sock)
            else:
                sock.close()

    def _closed(self, conn: _Conn, why: str, abort: bool) -> None:
        self._end(conn, abort)
        log.info("wan:%d close #%d up=%d down=%d%s", self.port, conn.n, conn.up, conn.down, why)

    def _shutdown(self) -> None:
        for conn in self._live():
            self._end(conn, abort=False)
            log.info("wan:%d close #%d up=%d down=%d (shutdown)", self.port, conn.n, conn.up, conn.down)
        if self._listener is not None:
            self._sel.unregister(self._listener)
            self._listener.close()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    def _link(self, n: int, direction: str) -> _Link:
        rng = random.Random(f"{self.seed}:{n}:{direction}") if self.seed is not None else random.Random()
        return _Link(self.delay_ms, self.jitter_ms, self.bandwidth_mbit, rng)


def _host_port(text: str, allow_zero: bool) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    if not (0 if allow_zero else 1) <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"port out of range in {text!r}")
    return host.strip("[]"), int(port)


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _positive(text: str) -> float:
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kit.wan",
        description="TCP proxy that emulates a WAN link: one-way delay, jitter and a bandwidth cap per "
                    "direction, never reordering bytes. SIGUSR1 cuts every open connection (RST, both sides) "
                    "and keeps listening; SIGTERM/SIGINT shut down cleanly. One line per connection event "
                    "on stderr. For `kit run --rtt-ms R` each stage<->relay link gets R/4 ms one way.")
    p.add_argument("--listen", required=True, type=lambda s: _host_port(s, allow_zero=True), metavar="HOST:PORT",
                   help="address to accept clients on; port 0 picks a free port (see --ready-file)")
    p.add_argument("--upstream", required=True, type=lambda s: _host_port(s, allow_zero=False),
                   metavar="HOST:PORT", help="address every accepted connection is forwarded to")
    p.add_argument("--delay-ms", type=_non_negative, default=0.0, metavar="D",
                   help="one-way delay added to each direction, in ms (default 0)")
    p.add_argument("--jitter-ms", type=_non_negative, default=0.0, metavar="J",
                   help="extra one-way delay drawn uniformly from [0, J] ms per chunk; order is kept (default 0)")
    p.add_argument("--bandwidth-mbit", type=_positive, default=None, metavar="B",
                   help="cap each direction at B Mbit/s (default: no cap)")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="seed for the jitter, for reproducible runs (default: random)")
    p.add_argument("--ready-file", default=None, metavar="F",
                   help="once listening, write the actual port to this file (written atomically)")
    p.add_argument("--spin", action="store_true",
                   help="poll the sockets without ever sleeping (one busy CPU core): bytes are picked up within "
                        "microseconds, as a router forwards them, instead of after a process wake-up, which "
                        "would add to the emulated delay on every hop (for benchmarks on machines with cores "
                        "to spare)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    host, port = args.listen
    emu = WanEmulator(*args.upstream, listen_host=host, listen_port=port, delay_ms=args.delay_ms,
                      jitter_ms=args.jitter_ms, bandwidth_mbit=args.bandwidth_mbit, seed=args.seed, spin=args.spin)
    try:
        emu.resolve()
    except socket.gaierror as e:
        print(f"python -m kit.wan: error: --upstream {args.upstream[0]}: cannot resolve ({e.strerror})", file=sys.stderr)
        return 2
    try:
        emu.listen()
    except OSError as e:
        print(f"python -m kit.wan: error: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return 1
    if args.ready_file:
        tmp = f"{args.ready_file}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(f"{emu.port}\n")
        os.replace(tmp, args.ready_file)
    signal.signal(signal.SIGUSR1, lambda *_: emu.request_cut())
    signal.signal(signal.SIGTERM, lambda *_: emu.stop())
    signal.signal(signal.SIGINT, lambda *_: emu.stop())
    bw = f"{args.bandwidth_mbit} Mbit/s" if args.bandwidth_mbit else "no cap"
    log.info("wan:%d listening on %s:%d -> %s:%d delay=%gms jitter=%gms bandwidth=%s", emu.port, host, emu.port,
             *args.upstream, args.delay_ms, args.jitter_ms, bw)
    emu.serve_forever()
    log.info("wan:%d stopped, cut %d connections, up=%d down=%d bytes", emu.port, emu.connections_cut,
             emu.bytes_up, emu.bytes_down)
    return 0


if __name__ == "__main__":
    sys.exit(main())
