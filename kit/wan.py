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
import asyncio
import logging
import os
import random
import signal
import socket
import struct
import sys

CHUNK = 64 * 1024
SPIN_S = 0.0015  # see _sleep_until
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


class _Conn:
    def __init__(self, n: int, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter):
        self.n = n
        self.client = client
        self.upstream = upstream
        self.tasks: list[asyncio.Task] = []
        self.up = 0
        self.down = 0
        self.ended = False  # cut or closed by us; the handler must not log it again


async def _sleep_until(loop: asyncio.AbstractEventLoop, when: float) -> None:
    """Wake at `when` within ~0.1 ms: the event loop's epoll waits in whole milliseconds and would make
    every hop ~1 ms late, so the last stretch is spent yielding to the loop instead of sleeping."""
    while (wait := when - loop.time()) > 0:
        await asyncio.sleep(wait - SPIN_S if wait > 2 * SPIN_S else 0)


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with RST: SO_LINGER 0 makes close() drop the connection instead of a graceful FIN."""
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None and sock.fileno() >= 0:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()


class WanEmulator:
    """One emulated WAN link in front of `upstream`; for in-process use, or run this module as a process.

    Counters: `connections_cut` (by cut_all), `bytes_up` (client -> upstream) and `bytes_down`
    (upstream -> client), counting bytes delivered out of the emulator.
    """

    def __init__(self, upstream_host: str, upstream_port: int, *, listen_host: str = "127.0.0.1",
                 listen_port: int = 0, delay_ms: float = 0.0, jitter_ms: float = 0.0,
                 bandwidth_mbit: float | None = None, seed: int | None = None):
        self.upstream_host, self.upstream_port = upstream_host, upstream_port
        self.listen_host, self.port = listen_host, listen_port
        self.delay_ms, self.jitter_ms, self.bandwidth_mbit, self.seed = delay_ms, jitter_ms, bandwidth_mbit, seed
        self.connections_cut = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._handlers: set[asyncio.Task] = set()
        self._count = 0

    async def start(self) -> int:
        """Start listening; returns the actual port (listen_port 0 picks a free one)."""
        self._server = await asyncio.start_server(self._handle, self.listen_host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def cut_all(self) -> int:
        """Abort every proxied connection on both sides (RST); keep listening. Returns how many."""
        conns = sorted(self._conns, key=lambda c: c.n)
        for conn in conns:
            self._end(conn, abort=True)
            log.info("wan:%d cut #%d up=%d down=%d", self.port, conn.n, conn.up, conn.down)
        self.connections_cut += len(conns)
        return len(conns)

    async def close(self) -> None:
        """Stop listening and close every connection (FIN; data still waiting in the link is dropped)."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            self._end(conn, abort=False)
            log.info("wan:%d close #%d up=%d down=%d (shutdown)", self.port, conn.n, conn.up, conn.down)
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def _end(self, conn: _Conn, abort: bool) -> None:
        conn.ended = True
        self._conns.discard(conn)
        for task in conn.tasks:
            task.cancel()
        for writer in (conn.client, conn.upstream):
            if abort:
                _abort(writer)
            else:
                writer.close()

    def _link(self, n: int, direction: str) -> _Link:
        rng = random.Random(f"{self.seed}:{n}:{direction}") if self.seed is not None else random.Random()
        return _Link(self.delay_ms, self.jitter_ms, self.bandwidth_mbit, rng)

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self._handlers.add(asyncio.current_task())
        self._count += 1
        n = self._count
        peer = cwriter.get_extra_info("peername")
        peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        upstream = f"{self.upstream_host}:{self.upstream_port}"
        try:
            _nodelay(cwriter)
            try:
                ureader, uwriter = await asyncio.open_connection(self.upstream_host, self.upstream_port)
            except OSError as e:
                log.warning("wan:%d #%d from %s: upstream %s unreachable: %s", self.port, n, peer, upstream,
                            e.strerror or e)
                _abort(cwriter)
                return
            _nodelay(uwriter)
            conn = _Conn(n, cwriter, uwriter)
            self._conns.add(conn)
            log.info("wan:%d open #%d %s -> %s", self.port, n, peer, upstream)
            up, down = asyncio.Queue(QUEUE_CHUNKS), asyncio.Queue(QUEUE_CHUNKS)
            conn.tasks = [
                asyncio.create_task(self._read(creader, up, self._link(n, "up"))),
                asyncio.create_task(self._send(up, uwriter, conn, "up")),
                asyncio.create_task(self._read(ureader, down, self._link(n, "down"))),
                asyncio.create_task(self._send(down, cwriter, conn, "down")),
            ]
            try:
                done, _ = await asyncio.wait(conn.tasks, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                for task in conn.tasks:
                    task.cancel()
            if conn.ended:
                return
            errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
            self._end(conn, abort=bool(errors))
            why = f" reset: {errors[0]!r}" if errors else ""
            log.info("wan:%d close #%d up=%d down=%d%s", self.port, n, conn.up, conn.down, why)
        except asyncio.CancelledError:  # close(); Python 3.11's streams would log a cancelled handler as an error
            cwriter.close()
        finally:
            self._handlers.discard(asyncio.current_task())

    async def _read(self, reader: asyncio.StreamReader, queue: asyncio.Queue, link: _Link) -> None:
        loop = asyncio.get_running_loop()
        while data := await reader.read(CHUNK):
            await queue.put((link.release_time(loop.time(), len(data)), data))
        await queue.put((link.release_time(loop.time(), 0), b""))

    async def _send(self, queue: asyncio.Queue, writer: asyncio.StreamWriter, conn: _Conn, direction: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            release, data = await queue.get()
            await _sleep_until(loop, release)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            if direction == "up":
                conn.up += len(data)
                self.bytes_up += len(data)
            else:
                conn.down += len(data)
                self.bytes_down += len(data)
            writer.write(data)
            await writer.drain()


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


async def _spin() -> None:
    while True:  # a ready task keeps the event loop's epoll from blocking
        await asyncio.sleep(0)


async def _serve(args: argparse.Namespace) -> int:
    host, port = args.listen
    up_host, up_port = args.upstream
    try:
        await asyncio.get_running_loop().getaddrinfo(up_host, up_port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        print(f"python -m kit.wan: error: --upstream {up_host}: cannot resolve ({e.strerror})", file=sys.stderr)
        return 2
    emu = WanEmulator(up_host, up_port, listen_host=host, listen_port=port, delay_ms=args.delay_ms,
                      jitter_ms=args.jitter_ms, bandwidth_mbit=args.bandwidth_mbit, seed=args.seed)
    try:
        await emu.start()
    except OSError as e:
        print(f"python -m kit.wan: error: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return 1
    if args.ready_file:
        tmp = f"{args.ready_file}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(f"{emu.port}\n")
        os.replace(tmp, args.ready_file)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, emu.cut_all)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    spinner = loop.create_task(_spin()) if args.spin else None
    bw = f"{args.bandwidth_mbit} Mbit/s" if args.bandwidth_mbit else "no cap"
    log.info("wan:%d listening on %s:%d -> %s:%d delay=%gms jitter=%gms bandwidth=%s", emu.port, host, emu.port,
             up_host, up_port, args.delay_ms, args.jitter_ms, bw)
    await stop.wait()
    if spinner:
        spinner.cancel()
    await emu.close()
    log.info("wan:%d stopped, cut %d connections, up=%d down=%d bytes", emu.port, emu.connections_cut,
             emu.bytes_up, emu.bytes_down)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    return asyncio.run(_serve(args))


if __name__ == "__main__":
    sys.exit(main())
