"""Fixtures of the explorer tests: a tiny gated atlas with a hostile corpus, and the real ``kvmem serve`` on it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import kvmem

ROOT = Path(__file__).resolve().parents[1]
HOSTILE = ["Plain words first. <script>alert(1)</script> then more plain words follow here. " * 3,
           'A quote "><img src=x onerror=alert(1)> and an ampersand &amp; stay text. ' * 3,
           "Odd \u202eevil\u202c text and zero\u200bwidth space; \u05e9\u05dc\u05d5\u05dd read right to left.\n\tindented\n" * 3]
EXPLAINED = [(layer, neuron) for layer in (0, 1) for neuron in range(6)]


def _corpus() -> list[str]:
    from pydoc_data.topics import topics

    return HOSTILE + [topics[key] for key in sorted(topics)[:5]]  # the hostile ones first: max_tokens cuts the rest


@pytest.fixture(scope="session")
def explorer_atlas(llama_dir, tmp_path_factory) -> Path:
    """The tiny random-init Llama (gated) scanned over pydoc text and the hostile documents, with a taxonomy table
    and scored ``tokens`` explanations of twelve neurons."""
    from kvmem.taxonomy.table import FILE, build_taxonomy, write_taxonomy

    model = kvmem.load_model(llama_dir, device="cpu")
    assert (model.n_layers, model.d_ff, model.gated) == (2, 96, True)
    root = tmp_path_factory.mktemp("explorer")
    atlas = kvmem.scan(model, _corpus(), out=root / "atlas", top_k=6, window=48, max_tokens=2400, per_document=True,
                       random_samples=8, progress=False, projections="eager")  # search by promoted token reads them
    frame, metadata = build_taxonomy(model, atlas=atlas)
    write_taxonomy(frame, metadata, atlas.path / FILE)
    kvmem.explain(atlas, neurons=EXPLAINED)
    kvmem.score(atlas, neurons=EXPLAINED)
    return atlas.path


def server_env() -> dict:
    """The environment of a server subprocess: this checkout's kvmem first, one thread."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class Server:
    """A real ``kvmem serve`` subprocess."""

    process: subprocess.Popen
    url: str
    banner: str
    stderr_path: Path
    requests: list[str] = field(default_factory=list)

    def get(self, path: str, *, method: str = "GET", headers: dict | None = None) -> tuple[int, dict, bytes]:
        """(status, headers, body) of one request; redirects are not followed."""
        request = urllib.request.Request(self.url.rstrip("/") + path, method=method, headers=headers or {})
        opener = urllib.request.build_opener(_NoRedirect())
        try:
            with opener.open(request, timeout=120) as response:
                return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
        except urllib.error.HTTPError as error:
            return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()

    def json(self, path: str) -> tuple[int, dict]:
        status, _, body = self.get(path)
        return status, json.loads(body)

    def wait_model(self, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _, status = self.json("/api/status")
            if status["model"]["state"] != "loading":
                return status["model"]
            time.sleep(0.2)
        raise AssertionError("the model did not load in time")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(20)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def start_server(atlas: Path, *args: str, log: Path, timeout: float = 120) -> Server:
    """Start ``kvmem serve --atlas ATLAS --port 0 ARGS`` and wait for the URL it prints."""
    err = open(log, "w")
    process = subprocess.Popen([sys.executable, "-m", "kvmem", "serve", "--atlas", str(atlas), "--port", "0", *args],
                               stdout=subprocess.PIPE, stderr=err, text=True, env=server_env(), cwd=str(log.parent))
    err.close()
    deadline = time.monotonic() + timeout
    line = ""
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if line or process.poll() is not None:
            break
    match = re.search(r"(http://\S+/)", line)
    if match is None:
        process.kill()
        raise AssertionError(f"kvmem serve printed no URL: {line!r}; stderr: {log.read_text()[-2000:]}")
    return Server(process=process, url=match.group(1), banner=line, stderr_path=log)


@pytest.fixture(scope="session")
def explorer_server(explorer_atlas, tmp_path_factory):
    """``kvmem serve`` on the explorer atlas with its model (loaded in the background)."""
    server = start_server(explorer_atlas, log=tmp_path_factory.mktemp("serve") / "stderr.log")
    yield server
    server.stop()


def atlas_digest(path: Path) -> dict[str, str]:
    """Every file of an atlas directory with the sha256 of its bytes."""
    import hashlib

    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def copy_atlas(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target
