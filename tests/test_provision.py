"""relay.provision against a real sshd on 127.0.0.1: the setup script runs for real, the relay it starts is
checked through TLS and the handshake, and a 2-stage run goes through it with the card.

Needs root and openssh-server; CI has both. Every install goes to its own prefix under /tmp, so tests never
touch /opt or /etc/kit-relay; they do add the system user `kitrelay` (as the setup script does on a VM).
"""
from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
SSHD = "/usr/sbin/sshd"
PID_FILE = "var/lib/kit-relay/relay.pid"

needs_sshd = pytest.mark.skipif(not os.path.exists(SSHD), reason="sshd not installed (apt-get install openssh-server)")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the setup script must run as root (creates a system user)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keygen(path: Path) -> str:
    """Make an ed25519 key pair at `path` and return its public key's SHA256 fingerprint."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    out = subprocess.run(["ssh-keygen", "-l", "-E", "sha256", "-f", f"{path}.pub"], check=True,
                         capture_output=True, text=True).stdout
    return out.split()[1]


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture(scope="module")
def sshd():
    """A throwaway sshd on a free loopback port that lets root in with a generated key."""
    d = Path(tempfile.mkdtemp(prefix="kit-sshd-test-", dir="/tmp"))
    d.chmod(0o755)  # other users read authorized_keys here (test_sudo_password_is_named)
    host_fp = keygen(d / "host_key")
    keygen(d / "user_key")
    keygen(d / "wrong_key")
    other_host_fp = keygen(d / "other_host_key")
    (d / "authorized_keys").write_text((d / "user_key.pub").read_text())
    (d / "authorized_keys").chmod(0o644)
    port = free_port()
    (d / "sshd_config").write_text(f"""\
Port {port}
ListenAddress 127.0.0.1
HostKey {d / 'host_key'}
AuthorizedKeysFile {d / 'authorized_keys'}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
StrictModes no
UsePAM no
PidFile {d / 'sshd.pid'}
Subsystem sftp internal-sftp
LogLevel VERBOSE
""")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    log = open(d / "sshd.log", "wb")
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port)
        yield SimpleNamespace(port=port, dir=d, key=d / "user_key", wrong_key=d / "wrong_key", host_fp=host_fp,
                              other_host_fp=other_host_fp, log=d / "sshd.log")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
        shutil.rmtree(d, ignore_errors=True)


def running(pid: int) -> bool:
    """Alive and not a zombie (a zombie's command line is empty; a container's init may never reap it)."""
    try:
        return bool(Path(f"/proc/{pid}/cmdline").read_bytes())
    except OSError:
        return False


def kill_relay(prefix: Path) -> None:
    pid_file = prefix / PID_FILE
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def make_prefix():
    """Fresh install prefixes (readable by the service user); their relays are killed at the end."""
    made = []

    def make() -> Path:
        p = Path(tempfile.mkdtemp(prefix="kit-relay-test-", dir="/tmp"))
        p.chmod(0o755)
        made.append(p)
        return p

    yield make
    for p in made:
        kill_relay(p)
        shutil.rmtree(p, ignore_errors=True)


def provision(sshd, *extra: str, key: Path | None = None, pin: tuple[str, ...] | None = None,
              timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "relay.provision", "--host", "127.0.0.1", "--ssh-port", str(sshd.port),
           "--user", "root", "--key", str(key or sshd.key), *(pin or ("--host-key", sshd.host_fp)),
           "--timeout", "10", *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def check_relay(card: dict) -> None:
    """TLS pinned to the card's fingerprint, then the handshake with the card's token: raises if either fails."""
    from relay.protocol import client_handshake, pinned_tls_wrap

    host, port = card["relay"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        tls = pinned_tls_wrap(sock, card["fingerprint"])
        client_handshake(tls, "test-check", 0, 2, card["token"].encode())
        tls.close()


@pytest.fixture(scope="module")
def provisioned(sshd, tmp_path_factory):
    """One relay provisioned through sshd, shared by the tests that need a running relay."""
    prefix = Path(tempfile.mkdtemp(prefix="kit-relay-test-", dir="/tmp"))
    prefix.chmod(0o755)
    d = tmp_path_factory.mktemp("card")
    port, metrics = free_port(), free_port()
    t0 = time.monotonic()
    r = provision(sshd, "--port", str(port), "--metrics-port", str(metrics), "--prefix", str(prefix),
                  "--card-file", str(d / "card.json"))
    try:
        yield SimpleNamespace(result=r, seconds=time.monotonic() - t0, prefix=prefix, port=port, metrics=metrics,
                              card_file=d / "card.json", dir=d)
    finally:
        kill_relay(prefix)
        shutil.rmtree(prefix, ignore_errors=True)


@needs_sshd
@needs_root
def test_provision_starts_a_working_relay(sshd, provisioned):
    r = provisioned.result
    assert r.returncode == 0, r.stderr
    assert "Accepted publickey for root" in sshd.log.read_text()  # what the wrong-host-key test counts
    card = json.loads(provisioned.card_file.read_text())
    assert card["relay"] == f"127.0.0.1:{provisioned.port}"
    assert len(card["token"]) == 64 and card["fingerprint"] and card["created"] and card["session"]
    assert stat.S_IMODE(provisioned.card_file.stat().st_mode) == 0o600
    check_relay(card)
    with pytest.raises(Exception):
        check_relay(dict(card, token="00" * 32))
    with urllib.request.urlopen(f"http://127.0.0.1:{provisioned.metrics}/healthz", timeout=5) as resp:
        assert resp.status == 200
    token_file = provisioned.prefix / "etc/kit-relay/token"
    st = token_file.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert pwd.getpwuid(st.st_uid).pw_name == "kitrelay"
    pid = int((provisioned.prefix / PID_FILE).read_text())
    uid = next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("Uid:"))
    assert pwd.getpwuid(int(uid)).pw_name == "kitrelay"  # not root


@needs_sshd
@needs_root
def test_second_run_is_idempotent(sshd, provisioned):
    assert provisioned.result.returncode == 0, provisioned.result.stderr
    first = json.loads(provisioned.card_file.read_text())
    old_pid = int((provisioned.prefix / PID_FILE).read_text())
    known_hosts = provisioned.dir / "known_hosts"
    host_pub = (sshd.dir / "host_key.pub").read_text().split()
    known_hosts.write_text(f"[127.0.0.1]:{sshd.port} {host_pub[0]} {host_pub[1]}\n")
    card2 = provisioned.dir / "card2.json"
    r = provision(sshd, "--port", str(provisioned.port), "--metrics-port", str(provisioned.metrics),
                  "--prefix", str(provisioned.prefix), "--card-file", str(card2),
                  pin=("--known-hosts", str(known_hosts)))
    assert r.returncode == 0, r.stderr
    second = json.loads(card2.read_text())
    assert (second["token"], second["fingerprint"]) == (first["token"], first["fingerprint"])
    new_pid = int((provisioned.prefix / PID_FILE).read_text())
    assert new_pid != old_pid and not running(old_pid)  # restarted onto the new code
    check_relay(second)
    with urllib.request.urlopen(f"http://127.0.0.1:{provisioned.metrics}/healthz", timeout=5) as resp:
        assert resp.status == 200


@needs_sshd
@needs_root
def test_rotate_token(sshd, make_prefix, tmp_path):
    prefix, port = make_prefix(), free_port()
    r1 = provision(sshd, "--port", str(port), "--prefix", str(prefix), "--card-file", str(tmp_path / "a.json"))
    assert r1.returncode == 0, r1.stderr
    r2 = provision(sshd, "--port", str(port), "--prefix", str(prefix), "--card-file", str(tmp_path / "b.json"),
                   "--rotate-token")
    assert r2.returncode == 0, r2.stderr
    a, b = (json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json"))
    assert a["fingerprint"] == b["fingerprint"] and a["token"] != b["token"]
    check_relay(b)
    with pytest.raises(Exception):
        check_relay(a)


@needs_sshd
@needs_root
@pytest.mark.parametrize("how", ["pinned", "known_hosts", "unknown_host"])
def test_wrong_host_key_aborts_before_upload(sshd, tmp_path, how):
    prefix = tmp_path / "never"
    other_pub = (sshd.dir / "other_host_key.pub").read_text().split()
    known_hosts = tmp_path / "known_hosts"
    if how == "pinned":
        pin, expect = ("--host-key", sshd.other_host_fp), ["host key mismatch", sshd.other_host_fp, sshd.host_fp]
    elif how == "known_hosts":
        known_hosts.write_text(f"[127.0.0.1]:{sshd.port} {other_pub[0]} {other_pub[1]}\n")
        pin, expect = ("--known-hosts", str(known_hosts)), ["host key mismatch", sshd.other_host_fp, sshd.host_fp]
    else:
        known_hosts.write_text(f"[127.0.0.1]:1 {other_pub[0]} {other_pub[1]}\n")
        pin, expect = ("--known-hosts", str(known_hosts)), ["is not in", str(known_hosts)]
    accepted_before = sshd.log.read_text().count("Accepted publickey")
    r = provision(sshd, "--port", str(free_port()), "--prefix", str(prefix), "--card-file", str(tmp_path / "c.json"),
                  pin=pin)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and all(e in lines[0] for e in expect), r.stderr
    assert not prefix.exists() and not (tmp_path / "c.json").exists()
    time.sleep(0.2)  # let sshd flush its log
    assert sshd.log.read_text().count("Accepted publickey") == accepted_before  # never even logged in


@needs_sshd
@needs_root
def test_wrong_ssh_key_is_a_clear_error(sshd, tmp_path):
    prefix = tmp_path / "never"
    r = provision(sshd, "--port", str(free_port()), "--prefix", str(prefix), "--card-file", str(tmp_path / "c.json"),
                  key=sshd.wrong_key)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "refused" in lines[0] and str(sshd.wrong_key) in lines[0], r.stderr
    assert not prefix.exists()


@needs_sshd
@needs_root
@pytest.mark.skipif(shutil.which("sudo") is None, reason="sudo not installed")
def test_sudo_password_is_named(sshd, tmp_path):
    user = "kitprovtest"
    if subprocess.run(["id", user], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/bin/bash", user],
                       check=True)
    subprocess.run(["usermod", "-p", "*", user], check=True)  # key login only; "!" would lock it for sshd
    try:
        cmd = [sys.executable, "-m", "relay.provision", "--host", "127.0.0.1", "--ssh-port", str(sshd.port),
               "--user", user, "--key", str(sshd.key), "--host-key", sshd.host_fp, "--timeout", "10",
               "--port", str(free_port()), "--prefix", str(tmp_path / "never"), "--card-file", str(tmp_path / "c")]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    finally:
        subprocess.run(["userdel", user], check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "sudo on the VM asks kitprovtest for a password" in r.stderr, r.stderr
    assert not (tmp_path / "never").exists()


def test_closed_relay_port_names_the_security_group():
    from relay.provision import ProvisionError, check_relay as provision_check

    with pytest.raises(ProvisionError, match="Security Groups → Inbound rules: add Custom TCP"):
        provision_check("127.0.0.1", free_port(), "00" * 32, "00" * 32, timeout=1)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_setup_script_passes_shellcheck():
    r = subprocess.run(["shellcheck", str(ROOT / "infra/ec2_setup.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_sshd
@needs_root
@pytest.mark.skipif(not (ROOT / "kit/node.py").exists() or not (ROOT / "kit/__main__.py").exists(),
                    reason="the node runtime (kit/node.py, kit/__main__.py) is not written yet")
@pytest.mark.timeout(300)
def test_two_stage_run_through_provisioned_relay(provisioned, request):
    assert provisioned.result.returncode == 0, provisioned.result.stderr
    try:
        smol = request.getfixturevalue("smol_dir")
    except pytest.FixtureLookupError:
        pytest.skip("no smol_dir fixture in tests/conftest.py yet")
    relay_log = provisioned.prefix / "var/log/kit-relay/relay.log"
    joined_before = relay_log.read_text().count("event=stage_up")
    r = subprocess.run([sys.executable, "-m", "kit", "run", "--target", str(smol), "--draft", "ngram", "--stages", "2",
                        "--max-new-tokens", "8", "--prompt-ids", "1,2,3,4", "--relay", f"127.0.0.1:{provisioned.port}",
                        "--relay-card", str(provisioned.card_file), "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(result["token_ids"]) == 8
    joined = [line for line in relay_log.read_text().splitlines() if "event=stage_up" in line][joined_before:]
    assert {line.split(" stage=")[1].split()[0] for line in joined} >= {"0", "1"}  # both stages used this relay
