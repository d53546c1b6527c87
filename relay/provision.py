"""Provision a relay on a fresh VM over SSH and prove it answers: one command, one relay card.

    python -m relay.provision --host H --user U --key PEM (--known-hosts F | --host-key SHA256:...)

Uploads the relay package and infra/ec2_setup.sh over SFTP, runs the script with sudo, then connects
to the relay from here through TLS pinned to the certificate the script reports and completes the
session handshake with the token. The card it writes (relay, fingerprint, token, session, created) is
what the notebooks and `kit node` read.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import logging
import os
import re
import secrets
import shlex
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import paramiko

from relay.protocol import (FingerprintMismatch, ProtocolError, client_handshake, normalize_fingerprint,
                            pinned_tls_wrap)

RELAY_DIR = Path(__file__).resolve().parent
SETUP_SCRIPT = RELAY_DIR.parent / "infra" / "ec2_setup.sh"
SECURITY_GROUP_HINT = ("EC2 console → Security Groups → Inbound rules: add Custom TCP {port} from 0.0.0.0/0 "
                       "(or your Kaggle egress)")


class ProvisionError(Exception):
    """A failure with a message fit to show the user as is."""


def ssh_fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's `SHA256:base64` fingerprint of a public key, as `ssh-keygen -l` prints it."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


class PinnedHostKey(paramiko.MissingHostKeyPolicy):
    """Accept the server only if its key has the pinned fingerprint; paramiko asks before authenticating."""

    def __init__(self, fingerprint: str):
        self.fingerprint = fingerprint if fingerprint.startswith("SHA256:") else "SHA256:" + fingerprint
        self.fingerprint = self.fingerprint.rstrip("=")

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        seen = ssh_fingerprint(key)
        if seen != self.fingerprint:
            raise ProvisionError(f"host key mismatch for {hostname}: expected {self.fingerprint}, "
                                 f"the server presented {key.get_name()} {seen}; nothing was uploaded")


def connect(args: argparse.Namespace) -> paramiko.SSHClient:
    """Open an SSH session whose host key was checked before any credential or file was sent."""
    try:
        pkey = paramiko.PKey.from_path(args.key)
    except FileNotFoundError:
        raise ProvisionError(f"SSH key file not found: {args.key}") from None
    except paramiko.PasswordRequiredException:
        raise ProvisionError(f"SSH key {args.key} is encrypted; decrypt a copy "
                             "(ssh-keygen -p -N '' -f COPY) and pass that") from None
    except (paramiko.SSHException, ValueError) as e:
        raise ProvisionError(f"cannot read SSH key {args.key}: {e}") from None
    client = paramiko.SSHClient()
    if args.known_hosts:
        try:
            client.load_host_keys(args.known_hosts)
        except OSError as e:
            raise ProvisionError(f"cannot read --known-hosts {args.known_hosts}: {e}") from None
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
    else:
        client.set_missing_host_key_policy(PinnedHostKey(args.host_key))
    try:
        client.connect(args.host, port=args.ssh_port, username=args.user, pkey=pkey, timeout=args.timeout,
                       banner_timeout=args.timeout, auth_timeout=args.timeout, allow_agent=False,
                       look_for_keys=False)
    except ProvisionError:
        client.close()
        raise
    except paramiko.BadHostKeyException as e:
        client.close()
        raise ProvisionError(f"host key mismatch for {args.host}: {args.known_hosts} has "
                             f"{ssh_fingerprint(e.expected_key)}, the server presented {e.key.get_name()} "
                             f"{ssh_fingerprint(e.key)}; nothing was uploaded") from None
    except paramiko.AuthenticationException:
        client.close()
        raise ProvisionError(f"SSH login as {args.user}@{args.host} with key {args.key} was refused: wrong key "
                             "or user (EC2 default users: ec2-user on Amazon Linux, ubuntu on Ubuntu)") from None
    except paramiko.SSHException as e:
        client.close()
        if "not found in known_hosts" in str(e):
            raise ProvisionError(f"{args.host} is not in {args.known_hosts} (port {args.ssh_port}); add it or pin "
                                 "its key with --host-key SHA256:...; nothing was uploaded") from None
        raise ProvisionError(f"SSH to {args.host}:{args.ssh_port} failed: {e}") from None
    except (OSError, EOFError) as e:
        client.close()
        raise ProvisionError(f"cannot reach SSH at {args.host}:{args.ssh_port}: {e or type(e).__name__} "
                             "(is the VM running, and is port 22 open to your address in its security group?)"
                             ) from None
    return client


def run_remote(client: paramiko.SSHClient, command: str, timeout: float, echo: bool = False) -> tuple[int, str, str]:
    """Run `command`, reading stdout and stderr as they come so a full window never blocks the exit status."""
    chan = client.get_transport().open_session(timeout=timeout)
    chan.exec_command(command)
    chan.shutdown_write()
    out, err, line = bytearray(), bytearray(), bytearray()
    deadline = time.monotonic() + timeout
    while True:
        busy = False
        while chan.recv_ready():
            out += chan.recv(65536)
            busy = True
        while chan.recv_stderr_ready():
            data = chan.recv_stderr(65536)
            err += data
            busy = True
            if echo:
                line += data
                *done, rest = line.split(b"\n")
                for d in done:
                    print("  vm:", d.decode(errors="replace"), file=sys.stderr, flush=True)
                line = bytearray(rest)
        if not busy and chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
            break
        if time.monotonic() > deadline:
            chan.close()
            raise ProvisionError(f"remote command timed out after {timeout:.0f} s: {command}")
        if not busy:
            time.sleep(0.05)
    if echo and line:
        print("  vm:", line.decode(errors="replace"), file=sys.stderr, flush=True)
    return chan.recv_exit_status(), out.decode(errors="replace"), err.decode(errors="replace")


def upload(sftp: paramiko.SFTPClient, local: Path, remote: str) -> None:
    """Write to a temporary name, then rename over the target, so a cut connection never leaves half a file."""
    tmp = f"{remote}.tmp-{secrets.token_hex(4)}"
    sftp.put(str(local), tmp)
    sftp.posix_rename(tmp, remote)


def relay_files() -> list[Path]:
    """The relay package as the VM needs it: everything but this file (which needs paramiko)."""
    for needed in (RELAY_DIR / "server.py", SETUP_SCRIPT):
        if not needed.exists():
            raise ProvisionError(f"{needed} is missing: run from a full checkout of the kit")
    return sorted(p for p in RELAY_DIR.glob("*.py") if p.name != "provision.py")


def setup(client: paramiko.SSHClient, args: argparse.Namespace, files: list[Path]) -> dict[str, str]:
    """Upload the code and the setup script to a fresh remote folder, run it, return its KIT_* values."""
    status, out, err = run_remote(client, "mktemp -d /tmp/kit-relay-upload.XXXXXX", args.timeout)
    if status != 0:
        raise ProvisionError(f"cannot make a temporary folder on the VM: {err.strip() or out.strip()}")
    stage = out.strip()
    try:
        sftp = client.open_sftp()
        try:
            sftp.mkdir(f"{stage}/relay")
            for f in files:
                upload(sftp, f, f"{stage}/relay/{f.name}")
            upload(sftp, SETUP_SCRIPT, f"{stage}/ec2_setup.sh")
        finally:
            sftp.close()
        cmd = ["bash", f"{stage}/ec2_setup.sh", "--src", stage, "--port", str(args.port)]
        if args.metrics_port:
            cmd += ["--metrics-port", str(args.metrics_port)]
        if args.rotate_token:
            cmd.append("--rotate-token")
        if args.prefix:
            cmd += ["--prefix", args.prefix]
        command = shlex.join(cmd)
        if args.user != "root":
            command = "sudo -n " + command
        status, out, err = run_remote(client, command, args.setup_timeout, echo=True)
    finally:
        try:
            run_remote(client, f"rm -rf {shlex.quote(stage)}", args.timeout)
        except (paramiko.SSHException, OSError):
            pass  # the connection is gone; the error that broke it is the one to report
    if status != 0:
        if args.user != "root" and status == 127 and "sudo" in err:
            raise ProvisionError(f"there is no sudo on the VM; log in as root or install sudo for {args.user}")
        if "sudo:" in err and ("password" in err or "terminal" in err):
            raise ProvisionError(f"sudo on the VM asks {args.user} for a password; use a user with passwordless "
                                 "sudo (ec2-user / ubuntu on EC2) or add "
                                 f"'{args.user} ALL=(ALL) NOPASSWD:ALL' with visudo")
        last = err.strip().splitlines()[-1] if err.strip() else f"exit status {status}"
        raise ProvisionError(f"the setup script failed on the VM: {last}")
    values = dict(line.split("=", 1) for line in out.splitlines() if line.startswith("KIT_") and "=" in line)
    if "KIT_TOKEN" not in values or "KIT_FINGERPRINT" not in values:
        raise ProvisionError("the setup script did not report the token and fingerprint")
    return values


def check_relay(host: str, port: int, fingerprint: str, token: str, timeout: float) -> None:
    """Prove from this machine that the relay is reachable, shows the pinned certificate and knows the token."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=min(timeout, 10))
            break
        except socket.timeout:
            raise ProvisionError(f"the relay runs but {host}:{port} timed out from here: the port is closed to the "
                                 f"internet. {SECURITY_GROUP_HINT.format(port=port)}") from None
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise ProvisionError(f"the relay runs but {host}:{port} refused the connection from here (a firewall "
                                     f"rejects it?). {SECURITY_GROUP_HINT.format(port=port)}") from None
            time.sleep(0.5)
        except OSError as e:
            raise ProvisionError(f"cannot reach the relay at {host}:{port}: {e}. "
                                 f"{SECURITY_GROUP_HINT.format(port=port)}") from None
    try:
        sock.settimeout(timeout)
        tls = pinned_tls_wrap(sock, fingerprint)
        client_handshake(tls, f"provision-check-{secrets.token_hex(4)}", 0, 2, token)
        tls.close()
    except FingerprintMismatch as e:
        raise ProvisionError(f"{host}:{port} answers with another certificate than the one the setup made: something "
                             f"else listens there, or the network intercepts TLS ({e})") from None
    except (ProtocolError, OSError, ValueError) as e:
        raise ProvisionError(f"the relay at {host}:{port} failed the TLS/handshake check: {e}") from None
    finally:
        sock.close()


def write_card(path: Path, card: dict) -> None:
    """Write the card readable by its owner only: it holds the session token."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(card, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m relay.provision", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", required=True, help="public address (IP or DNS name) of the VM")
    p.add_argument("--user", required=True, help="SSH user: ec2-user (Amazon Linux), ubuntu (Ubuntu) or root; "
                                                 "a user other than root needs passwordless sudo")
    p.add_argument("--key", required=True, metavar="PEM",
                   help="private key file for the SSH login (the EC2 key pair .pem, unencrypted)")
    pin = p.add_mutually_exclusive_group(required=True)
    pin.add_argument("--known-hosts", metavar="FILE",
                     help="known_hosts file that holds the VM's host key (checked, never added to)")
    pin.add_argument("--host-key", metavar="SHA256:...",
                     help="the VM's SSH host key fingerprint as `ssh-keygen -lf` prints it "
                          "(EC2: Actions → Monitor and troubleshoot → Get system log)")
    p.add_argument("--ssh-port", type=int, default=22, metavar="N", help="SSH port of the VM (default 22)")
    p.add_argument("--port", type=int, default=7000, metavar="N",
                   help="TCP port the relay listens on; open it in the security group (default 7000)")
    p.add_argument("--metrics-port", type=int, default=0, metavar="N",
                   help="also serve /healthz and /metrics on this port on the VM (default 0: off); keep it "
                        "closed in the security group and reach it through an SSH tunnel")
    p.add_argument("--rotate-token", action="store_true",
                   help="replace the session token; notebooks holding the old card are then refused")
    p.add_argument("--prefix", default="", metavar="DIR",
                   help="install under DIR on the VM instead of / (tests, side-by-side installs); "
                        "the relay then runs detached, not under systemd")
    p.add_argument("--card-file", type=Path, default=Path("relay_card.json"), metavar="FILE",
                   help="where to write the relay card, JSON readable by you only (default relay_card.json)")
    p.add_argument("--timeout", type=float, default=20.0, metavar="S",
                   help="seconds for each network step: SSH connect, small remote commands, the relay check "
                        "(default 20)")
    p.add_argument("--setup-timeout", type=float, default=900.0, metavar="S",
                   help="seconds the setup script may run on the VM; it may install python3 (default 900)")
    args = p.parse_args(argv)
    if args.host_key and not re.fullmatch(r"(SHA256:)?[A-Za-z0-9+/]{43}=?", args.host_key):
        p.error(f"--host-key must be an OpenSSH SHA256 fingerprint like SHA256:{'x' * 43} "
                f"(ssh-keygen -lf KEY.pub), got {args.host_key!r}")
    for name in ("ssh_port", "port"):
        if not 1 <= getattr(args, name) <= 65535:
            p.error(f"--{name.replace('_', '-')} must be 1..65535")
    if not 0 <= args.metrics_port <= 65535:
        p.error("--metrics-port must be 0..65535")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("paramiko").addHandler(logging.NullHandler())  # its tracebacks would bury our one line
    try:
        files = relay_files()
        client = connect(args)
        try:
            values = setup(client, args, files)
        finally:
            client.close()
        try:
            fingerprint = normalize_fingerprint(values["KIT_FINGERPRINT"])
        except ValueError as e:
            raise ProvisionError(f"the setup script reported a bad certificate fingerprint: {e}") from None
        token = values["KIT_TOKEN"]
        check_relay(args.host, args.port, fingerprint, token, args.timeout)
        host = f"[{args.host}]" if ":" in args.host else args.host
        card = {"relay": f"{host}:{args.port}", "fingerprint": fingerprint, "token": token,
                "session": f"kit-{secrets.token_hex(4)}",
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        try:
            write_card(args.card_file, card)
        except OSError as e:
            raise ProvisionError(f"the relay is up but the card could not be written to {args.card_file}: {e}; "
                                 f"card: {json.dumps(card)}") from None
    except ProvisionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (paramiko.SSHException, OSError, EOFError) as e:
        print(f"error: SSH connection to {args.host} lost: {e or type(e).__name__}", file=sys.stderr)
        return 1
    print(f"relay is up ({values.get('KIT_MODE', '?')}); relay card written to {args.card_file}:")
    print(f"  relay        {card['relay']}")
    print(f"  fingerprint  {card['fingerprint']}")
    print(f"  token        {card['token']}")
    print(f"  session      {card['session']}   (any name; every stage of one run uses the same one)")
    print(json.dumps(card))
    return 0


if __name__ == "__main__":
    sys.exit(main())
