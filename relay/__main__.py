"""python -m relay: run the relay (standard library only)."""
from __future__ import annotations

import argparse
import asyncio
import sys

from relay.protocol import MAX_PAYLOAD, clean_token
from relay.server import Config, serve, tls_context


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m relay", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description="Relay that joins the kit's stages (which can only dial out) into "
                                            "one ring per session. Protocol: docs/PROTOCOL.md.")
    p.add_argument("--port", type=int, default=7000, help="TCP port to listen on (0: any free port, logged)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--token-file", required=True,
                   help="file holding the session token (surrounding whitespace ignored); it never crosses the wire")
    p.add_argument("--cert", help="PEM certificate: serve TLS (nodes pin its SHA-256 fingerprint); needs --key")
    p.add_argument("--key", help="PEM private key of --cert")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve /healthz and Prometheus /metrics over HTTP on this port (0: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics listener")
    p.add_argument("--max-frame-mb", type=float, default=16.0,
                   help=f"largest frame payload accepted, MiB (at most {MAX_PAYLOAD >> 20}); a larger one closes "
                        "its connection only")
    p.add_argument("--handshake-timeout", type=float, default=5.0,
                   help="seconds a new connection has to finish TLS and then the handshake")
    p.add_argument("--idle-timeout", type=float, default=30.0,
                   help="close an authenticated connection after this many seconds without a byte "
                        "(nodes send PING well within it)")
    p.add_argument("--stage-wait", type=float, default=15.0,
                   help="seconds a frame for an unconnected stage waits before the sender gets a "
                        "stage_unavailable ERROR")
    p.add_argument("--queue-mb", type=float, default=32.0,
                   help="bytes of frames that may wait for one unconnected stage, MiB")
    p.add_argument("--total-queue-mb", type=float, default=128.0,
                   help="bytes of frames that may wait for unconnected stages in all sessions, MiB")
    p.add_argument("--write-buffer-mb", type=float, default=2.0,
                   help="per-connection output buffer, MiB; senders to a connection over it are paused")
    p.add_argument("--auth-failures", type=int, default=10,
                   help="failed handshakes allowed per source address per --auth-window before that address is "
                        "refused (a token bucket; 0: no limit)")
    p.add_argument("--auth-window", type=float, default=60.0, help="seconds in which --auth-failures refill")
    p.add_argument("--max-pending-per-addr", type=int, default=64,
                   help="unfinished handshakes allowed at once from one source address")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="connections allowed at once in all; memory is bounded by about connections x "
                        "(--max-frame-mb + --write-buffer-mb) + --total-queue-mb")
    args = p.parse_args(argv)
    if bool(args.cert) != bool(args.key):
        p.error("--cert and --key go together")
    if not 0 <= args.port <= 65535 or not 0 <= args.metrics_port <= 65535:
        p.error("ports must be 0..65535")
    if not 0 < args.max_frame_mb <= MAX_PAYLOAD >> 20:
        p.error(f"--max-frame-mb must be in (0, {MAX_PAYLOAD >> 20}]")
    for name in ("handshake_timeout", "idle_timeout", "stage_wait", "queue_mb", "total_queue_mb", "write_buffer_mb",
                 "auth_window"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    for name in ("auth_failures", "max_pending_per_addr", "max_connections"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must not be negative")
    return args


def raise_fd_limit() -> None:
    """Every stage holds a socket; the default soft limit (1024) is lower than the hard one."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else 65536
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with open(args.token_file, "rb") as f:
            token = clean_token(f.read())
    except (OSError, ValueError) as e:
        print(f"error: cannot use token file {args.token_file}: {e}", file=sys.stderr)
        return 2
    mib = 1 << 20
    cfg = Config(token=token, host=args.host, port=args.port, cert=args.cert, key=args.key,
                 metrics_host=args.metrics_host, metrics_port=args.metrics_port,
                 max_payload=int(args.max_frame_mb * mib), handshake_timeout=args.handshake_timeout,
                 idle_timeout=args.idle_timeout, stage_wait=args.stage_wait, queue_bytes=int(args.queue_mb * mib),
                 total_queue_bytes=int(args.total_queue_mb * mib), write_buffer=int(args.write_buffer_mb * mib),
                 auth_failures=args.auth_failures, auth_window=args.auth_window,
                 max_pending_per_addr=args.max_pending_per_addr, max_connections=args.max_connections)
    ctx, fingerprint = None, ""
    if args.cert:
        try:
            ctx, fingerprint = tls_context(args.cert, args.key)
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            print(f"error: cannot load the TLS certificate {args.cert} / key {args.key}: {e}", file=sys.stderr)
            return 2
    raise_fd_limit()
    try:
        asyncio.run(serve(cfg, ctx, fingerprint))
    except OSError as e:
        where = f"{args.host}:{args.port}" + (f" or metrics port {args.metrics_port}" if args.metrics_port else "")
        print(f"error: cannot listen on {where}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
