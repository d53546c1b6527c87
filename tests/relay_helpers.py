"""Helpers for the relay tests: a real `python -m relay` process, certificates, a recording proxy, raw sockets."""
from __future__ import annotations

import os
import re
import secrets
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from relay.protocol import (HEADER_LEN, ProtocolError, client_handshake, fingerprint_of_der, parse_header,
                            read_frame)

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_cert(folder: Path, name: str = "relay") -> tuple:
    """A self-signed certificate made with the openssl CLI, as provisioning does; returns (cert, key, fingerprint)."""
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                    f"/CN={name}", "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key, fingerprint_of_der(ssl.PEM_cert_to_DER_cert(cert.read_text()))


class RelayProcess:
    """`python -m relay` on 127.0.0.1; its stderr goes to a file (read it with `log()`)."""

    def __init__(self, folder: Path, *args: str, token: str | None = None, tls: bool = False, port: int = 0):
        self.folder = folder
        self.token = token or secrets.token_hex(32)
        self.token_file = folder / f"token-{secrets.token_hex(4)}"
        self.token_file.write_text(self.token + "\n")
        self.args = list(args)
        self.fingerprint = None
        if tls:
            cert, key, self.fingerprint = make_cert(folder)
            self.args += ["--cert", str(cert), "--key", str(key)]
        self.metrics_port = free_port()
        self.port = port
        self.logs: list[Path] = []
        self.proc = None
        self.start()

    def start(self) -> None:
        log = self.folder / f"relay-{len(self.logs)}-{secrets.token_hex(3)}.log"
        self.logs.append(log)
        python = os.environ.get("KIT_RELAY_PYTHON", sys.executable)  # the VM's python3 may be older (>= 3.8)
        cmd = [python, "-m", "relay", "--host", "127.0.0.1", "--port", str(self.port), "--token-file",
               str(self.token_file), "--metrics-port", str(self.metrics_port), *self.args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("w"))
        deadline = time.monotonic() + 20
        while True:
            m = re.search(r"event=listening .*?port=(\d+)", log.read_text())
            if m:
                self.port = int(m.group(1))
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"relay did not start: {log.read_text()}")
            time.sleep(0.02)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return "".join(p.read_text() for p in self.logs)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def restart(self) -> None:
        self.stop()
        self.start()

    def rss_kb(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def http(self, path: str) -> tuple:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self) -> dict:
        """Prometheus text -> {'name{labels}': value}."""
        status, text = self.http("/metrics")
        assert status == 200
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


def raw_connect(address: str, timeout: float = 5.0) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def raw_node(address: str, session: str, stage: int, stages: int, token) -> socket.socket:
    """An authenticated raw socket (no client library): for tests that must misbehave after the handshake."""
    sock = raw_connect(address)
    client_handshake(sock, session, stage, stages, token)
    return sock


def drain_until_closed(sock: socket.socket, timeout: float) -> list:
    """Read frames until the peer closes; return them. Fails if the connection is still open after `timeout`."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    frames = []
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            frames.append(read_frame(sock))
        except (ConnectionError, ProtocolError):
            return frames
        except socket.timeout:
            raise AssertionError(f"the relay kept the connection open for {timeout} s") from None


class RecordingProxy:
    """TCP proxy that keeps every byte in both directions, to look for secrets on the wire."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.up = bytearray()  # client -> relay
        self.down = bytearray()  # relay -> client
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, server, self.up), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.down), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bytearray) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                with self.lock:
                    record += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def frames_in(data: bytes) -> list:
    """Split a recorded byte stream into (type, header+payload bytes) pairs."""
    out, pos = [], 0
    while pos + HEADER_LEN <= len(data):
        fields = parse_header(data[pos:pos + HEADER_LEN])
        end = pos + HEADER_LEN + fields[6]
        out.append((fields[0], bytes(data[pos:end])))
        pos = end
    return out

