"""The openai: backend against real servers: ``transformers serve`` over a tiny local chat model, and small HTTP
servers of this test process that answer, fail (500) or stall, to check retries, timeouts, clear errors,
the journal and the resume of a killed run (nothing asked twice)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import kvmem
from kvmem.autointerp import store
from kvmem.autointerp.api import JOURNAL
from kvmem.autointerp.explainers import BackendOptions
from kvmem.autointerp.prompts import PROMPTS
from kvmem.cli import main
from kvmem.errors import KvmemError

ROOT = Path(__file__).resolve().parents[1]
TRANSFORMERS = Path(sys.executable).with_name("transformers")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tiny_chat_dir, tmp_path_factory):
    """``transformers serve`` on the tiny chat model; yields (base URL, log file)."""
    if not TRANSFORMERS.exists():
        pytest.fail(f"{TRANSFORMERS} is missing: install transformers[serving] (the dev extra)")
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen([str(TRANSFORMERS), "serve", str(tiny_chat_dir), "--port", str(port), "--device",
                                   "cpu", "--log-level", "info"], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://localhost:{port}/health", timeout=2).read()
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    pytest.fail(f"transformers serve did not start: {log.read_text()[-2000:]}")
                time.sleep(0.5)
        yield f"http://localhost:{port}/v1", log
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


def _posts(log: Path) -> int:
    return log.read_text().count('"POST /v1/chat/completions HTTP/1.1" 200')


def test_explain_and_judge_through_transformers_serve(explain_atlas, served, tiny_chat_dir):
    url, log = served
    options = BackendOptions(model_name=str(tiny_chat_dir), concurrency=2, timeout=120)
    pairs = [(0, 3), (0, 4)]
    rows = kvmem.explain(explain_atlas, neurons=pairs, explainer=f"openai:{url}", options=options)
    assert len(rows) == 2 and all(isinstance(t, str) and t for t in rows.text)
    assert set(rows.explainer_model) == {str(tiny_chat_dir)} and set(rows.prompt_hash) == {PROMPTS["explain"].hash}
    assert (rows.rule == "").all() and all(len(c) for c in rows.explain_codes)
    journal = explain_atlas.path / JOURNAL
    assert len(journal.read_text().splitlines()) == 2 == _posts(log)
    kvmem.explain(explain_atlas, neurons=pairs, explainer=f"openai:{url}", options=options, overwrite=True)
    assert _posts(log) == 2  # answered from the journal: nothing asked twice
    scored = kvmem.score(explain_atlas, scorers="detection", judge=f"openai:{url}", explainer=f"openai:{url}",
                         neurons=[(0, 3)], per_band=3, options=options, n_boot=50)
    asked = _posts(log) - 2
    # one neuron of its layer: no derangement partner, so each held-out example is judged once
    assert scored.detection_baseline_from.tolist() == [-1]
    assert asked == int(scored.detection_n.sum()) == len(journal.read_text().splitlines()) - 2
    assert ((scored.detection >= 0) & (scored.detection <= 1)).all()
    assert all(j.startswith(f"openai:{url} detection:1:") for j in scored.detection_judge)


class _Chat(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat endpoint whose behaviour the test sets: answer, fail with 500, or stall."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        state = self.server.state
        with state["lock"]:
            state["bodies"].append(json.dumps(body, sort_keys=True))
            n = len(state["bodies"])
        mode = state["mode"](n)
        if mode == "stall":
            time.sleep(state.get("stall", 2.0))
        if mode in ("fail", "stall"):
            self.send_response(500)
            self.end_headers()
            return
        time.sleep(state.get("delay", 0.0))
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": "Explanation: fires on 'the'. yes"}}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(data.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def chat_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Chat)
    server.state = {"lock": threading.Lock(), "bodies": [], "mode": lambda n: "ok"}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_retries_then_answers(explain_atlas, chat_server):
    server, url = chat_server
    server.state["mode"] = lambda n: "fail" if n <= 2 else "ok"  # the first two attempts fail
    options = BackendOptions(retries=3, backoff=0.01, concurrency=1)
    rows = kvmem.explain(explain_atlas, neurons=[(0, 1)], explainer=f"openai:{url}", options=options)
    assert rows.text.tolist() == ["fires on 'the'. yes"]
    assert len(server.state["bodies"]) == 3 and len(set(server.state["bodies"])) == 1


def test_failing_server_one_line_nothing_lost_then_resume_asks_nothing_twice(explain_atlas, chat_server, capsys):
    server, url = chat_server
    server.state["mode"] = lambda n: "ok" if n <= 3 else "fail"  # three answers, then only errors
    argv = ["explain", "--atlas", str(explain_atlas.path), "--neurons", ",".join(f"0:{n}" for n in range(6)),
            "--explainer", f"openai:{url}", "--retries", "2", "--backoff", "0.01", "--concurrency", "1", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{url}/chat/completions failed after 3 attempt(s): HTTP 500" in err
    journal = (explain_atlas.path / JOURNAL).read_text().splitlines()
    assert len(journal) == 3  # the answers received are kept
    server.state["mode"] = lambda n: "ok"
    assert main(argv) == 0
    bodies = server.state["bodies"]
    answered = [b for i, b in enumerate(bodies) if i < 3] + bodies[3 + 3:]  # 3 answers, 3 failed attempts, then the rest
    assert len(answered) == 6 and len(set(answered)) == 6  # every request answered once, none asked twice
    assert len(store.read(explain_atlas.path)) == 6


def test_timeout_and_unreachable_name_the_url(explain_atlas, chat_server, capsys):
    server, url = chat_server
    server.state["mode"], server.state["stall"] = (lambda n: "stall"), 2.0
    options = BackendOptions(timeout=0.3, retries=1, backoff=0.01)
    with pytest.raises(KvmemError, match=r"/chat/completions failed after 2 attempt\(s\): no answer within 0.3 s"):
        kvmem.explain(explain_atlas, neurons=[(0, 1)], explainer=f"openai:{url}", options=options)
    dead = f"http://127.0.0.1:{_free_port()}/v1"
    assert main(["explain", "--atlas", str(explain_atlas.path), "--neurons", "0:1", "--explainer", f"openai:{dead}",
                 "--retries", "0", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"openai endpoint {dead}/chat/completions failed" in err and "cannot connect" in err


def test_killed_llm_run_resumes_without_asking_twice(explain_atlas, chat_server):
    server, url = chat_server
    server.state["delay"] = 0.3
    neurons = [(0, n) for n in range(8)]
    code = (f"import kvmem\nfrom kvmem.autointerp.explainers import BackendOptions\n"
            f"kvmem.explain({str(explain_atlas.path)!r}, neurons={neurons!r}, explainer='openai:{url}', "
            f"options=BackendOptions(concurrency=1))")
    child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    journal = explain_atlas.path / JOURNAL
    deadline = time.time() + 120
    while time.time() < deadline and child.poll() is None:
        if journal.exists() and len(journal.read_text().splitlines()) >= 2:
            break
        time.sleep(0.02)
    assert child.poll() is None, child.stderr.read().decode()[-2000:]
    child.send_signal(signal.SIGKILL)
    child.wait()
    kept = len(journal.read_text().splitlines())
    assert 2 <= kept < 8 and not (explain_atlas.path / store.FILE).exists()
    kvmem.explain(explain_atlas, neurons=neurons, explainer=f"openai:{url}", options=BackendOptions(concurrency=1))
    bodies = server.state["bodies"]
    # at most the one request in flight at the kill is sent again; every answered one is not
    assert len(set(bodies)) == 8 and len(bodies) <= 9
    assert len(store.read(explain_atlas.path)) == 8
