"""`python -m kit push`: the metadata it writes, the calls it prints, and the real `kaggle` package at work.

The push tests run the unmodified `kaggle` package (KaggleApi over kagglesdk) against a stand-in for
api.kaggle.com on 127.0.0.1: an HTTPS proxy (HTTPS_PROXY) that answers CONNECT with TLS for a test
certificate (REQUESTS_CA_BUNDLE), and records every request the package sends, so the test checks the
request objects kagglesdk built (ApiSaveKernelRequest, ...) and under which account each was made.
"""
from __future__ import annotations

import base64
import http.server
import json
import os
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def kit_push(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kit", "push", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_dry_run_writes_both_metadata_files_and_prints_the_calls(tmp_path):
    card = tmp_path / "card.json"
    card.write_text(json.dumps({"relay": "203.0.113.7:7000", "fingerprint": "SHA256:ab:cd", "token": "s3cret-token"}))
    r = kit_push("--dry-run", "--user0", "alice", "--user1", "bob", "--relay-card", str(card), "--session", "s1",
                 "--draft", "ngram", "--k", "6", "--prompt", "one", "--prompt", "two", "--param", "extra_args=--depth 2",
                 "--build", str(tmp_path / "build"), "--results", str(tmp_path / "res"))
    assert r.returncode == 0, r.stderr
    for node, user, slug, code_file in ((0, "alice", "kit-node0-iowa", "node0_iowa.ipynb"),
                                        (1, "bob", "kit-node1-oregon", "node1_oregon.ipynb")):
        folder = tmp_path / "build" / f"node{node}"
        meta = json.loads((folder / "kernel-metadata.json").read_text())
        assert meta["id"] == f"{user}/{slug}"
        assert meta["code_file"] == code_file and (folder / code_file).is_file()
        assert (meta["language"], meta["kernel_type"], meta["machine_shape"]) == ("python", "notebook", "NvidiaTeslaT4")
        assert meta["is_private"] is True and meta["enable_gpu"] is True and meta["enable_internet"] is True
        assert meta["dataset_sources"] == [] and meta["competition_sources"] == []
        assert "docker_image" not in meta
        from kaggle.api.kaggle_api_extended import KaggleApi
        from slugify import slugify
        assert slugify(meta["title"]) == slug  # what the kaggle package checks the title against
        assert meta["language"] in KaggleApi.valid_push_language_types
        assert meta["kernel_type"] in KaggleApi.valid_push_kernel_types
        # the exact calls, as the account that makes them
        assert f"[as {user}] kaggle kernels push -p {folder}" in r.stdout
        assert f"[as {user}] kaggle kernels status {user}/{slug}" in r.stdout
        assert f"[as {user}] kaggle kernels output {user}/{slug} -p {tmp_path / 'res' / f'node{node}'}" in r.stdout
        # the notebook copy: values after the parameters cell, never the token
        nb = json.loads((folder / code_file).read_text())
        tags = [c["metadata"].get("tags", []) for c in nb["cells"]]
        at = tags.index(["parameters"])
        assert tags[at + 1] == ["injected-parameters"]
        injected = {}
        exec("".join(nb["cells"][at + 1]["source"]), {}, injected)
        assert injected["relay"] == "203.0.113.7:7000" and injected["fingerprint"] == "SHA256:ab:cd"
        assert injected["session"] == "s1" and injected["extra_args"] == "--depth 2"
        if node == 0:
            assert injected["draft"] == "ngram" and injected["k"] == 6 and injected["prompts"] == ["one", "two"]
        else:
            assert "prompts" not in injected and "draft" not in injected
        assert "s3cret-token" not in (folder / code_file).read_text()
    assert "s3cret-token" not in r.stdout + r.stderr


def test_bad_input_is_one_clear_line(tmp_path):
    same = kit_push("--dry-run", "--user0", "alice", "--user1", "alice", "--build", str(tmp_path))
    assert same.returncode != 0 and "two different Kaggle accounts" in same.stderr and "Traceback" not in same.stderr
    none = kit_push("--dry-run", "--build", str(tmp_path))
    assert none.returncode != 0 and "--account0" in none.stderr and "Traceback" not in none.stderr
    token = kit_push("--param", "token=x", "--dry-run", "--user0", "a", "--user1", "b", "--build", str(tmp_path))
    assert token.returncode != 0 and "KIT_TOKEN" in token.stderr
    no_creds = kit_push("--user0", "a", "--user1", "b", "--build", str(tmp_path))
    assert no_creds.returncode != 0 and "--dry-run" in no_creds.stderr


def test_help_describes_every_option():
    r = kit_push("--help")
    assert r.returncode == 0
    for opt in ("--account0", "--account1", "--user0", "--user1", "--relay-card", "--relay", "--fingerprint",
                "--session", "--target", "--draft", "--k", "--max-new-tokens", "--prompt", "--load-in-4bit",
                "--kit-source", "--param", "--dataset", "--competition", "--build", "--results", "--poll",
                "--timeout", "--no-run", "--no-wait", "--dry-run"):
        assert opt in r.stdout


# -- a stand-in for api.kaggle.com, reached through an HTTPS proxy ------------------------------------------
class FakeKaggle(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, tls: ssl.SSLContext, fail_push: str = "", run_error: str = ""):
        super().__init__(("127.0.0.1", 0), Handler)
        self.tls, self.fail_push, self.run_error = tls, fail_push, run_error
        self.calls: list[tuple[str, str, dict]] = []
        self.polls: dict[str, int] = {}
        self.tokens = {"KGAT_bob_token": "bob"}


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_CONNECT(self):  # the proxy step: answer the tunnel ourselves, as api.kaggle.com
        self.send_response(200, "Connection established")
        self.end_headers()
        self.connection = self.server.tls.wrap_socket(self.connection, server_side=True)
        self.rfile = self.connection.makefile("rb")
        self.wfile = self.connection.makefile("wb")
        self.close_connection = False

    def reply(self, code: int, body: bytes, kind: str = "application/json"):
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # an output file's download URL
        self.server.calls.append(("GET " + self.path, self.headers.get("Authorization", ""), {}))
        self.reply(200, json.dumps({"file": self.path}).encode(), "application/octet-stream")

    def do_POST(self):
        assert self.headers["Host"] == "api.kaggle.com"
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        name = self.path.rsplit("/", 1)[-1]
        self.server.calls.append((name, self.headers.get("Authorization", ""), body))
        s = self.server
        if name == "IntrospectToken":
            user = s.tokens.get(body.get("token"))
            out = {"active": bool(user), "username": user or ""}
        elif name == "SaveKernel":
            if s.fail_push and body["slug"].startswith("alice/"):
                return self.reply(403, json.dumps({"code": 403, "message": s.fail_push}).encode())
            out = {"ref": "/code/" + body["slug"], "url": "https://www.kaggle.com/code/" + body["slug"],
                   "versionNumber": 1}
        elif name == "GetKernelSessionStatus":
            ref = f"{body['userName']}/{body['kernelSlug']}"
            s.polls[ref] = s.polls.get(ref, 0) + 1
            if s.polls[ref] == 1:
                out = {"status": "RUNNING"}
            elif s.run_error and ref.startswith("alice/"):
                out = {"status": "ERROR", "failureMessage": s.run_error}
            else:
                out = {"status": "COMPLETE"}
        elif name == "ListKernelSessionOutput":
            user = body["userName"]
            out = {"files": [{"fileName": f"{user}-summary.json",
                              "url": f"https://api.kaggle.com/download/{user}/summary.json"}],
                   "log": "MissingSettings: missing settings: token (KIT_TOKEN)" if s.run_error else "ok"}
        else:
            return self.reply(404, json.dumps({"code": 404, "message": f"unknown {name}"}).encode())
        self.reply(200, json.dumps(out).encode())


@pytest.fixture
def kaggle(tmp_path):
    """Start the stand-in; yield a factory of (server, env for `kit push`, the two credential files)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=api.kaggle.com",
                    "-addext", "subjectAltName=DNS:api.kaggle.com"], check=True, capture_output=True)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    alice, bob = tmp_path / "alice.json", tmp_path / "bob.token"
    alice.write_text(json.dumps({"username": "alice", "key": "alice-key"}))
    bob.write_text("KGAT_bob_token\n")
    servers = []

    def start(**kw):
        server = FakeKaggle(tls, **kw)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        proxy = f"http://127.0.0.1:{server.server_address[1]}"
        env = {"HTTPS_PROXY": proxy, "https_proxy": proxy, "REQUESTS_CA_BUNDLE": str(cert), "NO_PROXY": "",
               "no_proxy": "", "KAGGLE_USERNAME": "mallory", "KAGGLE_KEY": "ambient-key"}
        return server, env, alice, bob
    yield start
    for s in servers:
        s.shutdown()


def push_args(tmp_path, alice, bob, *extra):
    return ("--account0", str(alice), "--account1", str(bob), "--user1", "bob", "--relay", "127.0.0.1:7000",
            "--session", "s2", "--poll", "0.2", "--timeout", "60", "--build", str(tmp_path / "build"),
            "--results", str(tmp_path / "res"), *extra)


@pytest.mark.timeout(120)
def test_push_polls_and_fetches_each_notebook_under_its_own_account(tmp_path, kaggle):
    from kagglesdk.kernels.types.kernels_api_service import (ApiGetKernelSessionStatusRequest,
                                                              ApiListKernelSessionOutputRequest, ApiSaveKernelRequest)

    server, env, alice, bob = kaggle()
    r = kit_push(*push_args(tmp_path, alice, bob), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    alice_auth = "Basic " + base64.b64encode(b"alice:alice-key").decode()
    bob_auth = "Bearer KGAT_bob_token"
    # every call carries its own account's credentials, never the ambient KAGGLE_USERNAME/KAGGLE_KEY
    api_calls = [(n, a) for n, a, _ in server.calls if not n.startswith("GET ") and n != "IntrospectToken"]
    assert {a for _, a in api_calls} == {alice_auth, bob_auth}, server.calls
    saves = {body["slug"]: (auth, ApiSaveKernelRequest.from_dict(body)) for name, auth, body in server.calls
             if name == "SaveKernel"}
    assert all(body.get("dockerImage") is None for name, _, body in server.calls if name == "SaveKernel")
    assert list(saves) == ["bob/kit-node1-oregon", "alice/kit-node0-iowa"]  # node 1 first: node 0 waits for it
    for node, slug, auth, code_file in ((0, "alice/kit-node0-iowa", alice_auth, "node0_iowa.ipynb"),
                                        (1, "bob/kit-node1-oregon", bob_auth, "node1_oregon.ipynb")):
        sent_auth, req = saves[slug]
        assert sent_auth == auth
        assert (req.language, req.kernel_type, req.machine_shape) == ("python", "notebook", "NvidiaTeslaT4")
        assert req.is_private and req.enable_gpu and req.enable_internet and not req.enable_tpu
        assert req.dataset_data_sources == [] and req.competition_data_sources == []
        assert req.new_title == slug.split("/")[1].replace("-", " ")
        sent = json.loads(req.text)  # the notebook itself, with the injected parameters
        pushed = json.loads((tmp_path / "build" / f"node{node}" / code_file).read_text())
        assert [c["source"] if isinstance(c["source"], str) else "".join(c["source"]) for c in sent["cells"]] == \
            ["".join(c["source"]) for c in pushed["cells"]]
        assert any("relay = '127.0.0.1:7000'" in c["source"] for c in sent["cells"])
    polls = [(auth, ApiGetKernelSessionStatusRequest.from_dict(b)) for n, auth, b in server.calls
             if n == "GetKernelSessionStatus"]
    assert {(a, p.user_name, p.kernel_slug) for a, p in polls} == {(alice_auth, "alice", "kit-node0-iowa"),
                                                                   (bob_auth, "bob", "kit-node1-oregon")}
    assert len(polls) == 4  # RUNNING, then COMPLETE, for each
    outputs = [ApiListKernelSessionOutputRequest.from_dict(b) for n, _, b in server.calls
               if n == "ListKernelSessionOutput"]
    assert {(o.user_name, o.kernel_slug) for o in outputs} == {("alice", "kit-node0-iowa"), ("bob", "kit-node1-oregon")}
    assert json.loads((tmp_path / "res" / "node0" / "alice-summary.json").read_text()) == \
        {"file": "/download/alice/summary.json"}
    assert (tmp_path / "res" / "node1" / "bob-summary.json").is_file()
    assert (tmp_path / "res" / "node0" / "kit-node0-iowa.log").read_text() == "ok"
    assert "COMPLETE" in r.stdout and "notebooks/results.ipynb" in r.stdout


@pytest.mark.timeout(120)
def test_failed_push_says_what_to_do(tmp_path, kaggle):
    server, env, alice, bob = kaggle(fail_push="Phone verification is required to use GPUs")
    r = kit_push(*push_args(tmp_path, alice, bob), env=env)
    assert r.returncode == 1
    assert "pushing node 0 as alice failed" in r.stderr and "Phone verification is required" in r.stderr
    assert "Settings > Phone Verification" in r.stderr
    assert not any(n == "GetKernelSessionStatus" for n, _, _ in server.calls)  # no polling after a failed push


@pytest.mark.timeout(120)
def test_run_without_secrets_is_explained(tmp_path, kaggle):
    server, env, alice, bob = kaggle(run_error="The notebook failed")
    r = kit_push(*push_args(tmp_path, alice, bob), env=env)
    assert r.returncode == 1
    assert "node 0 ended as ERROR" in r.stderr and "Add-ons > Secrets" in r.stderr
    assert (tmp_path / "res" / "node0" / "alice-summary.json").is_file()  # the output is fetched all the same
