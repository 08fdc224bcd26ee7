"""The explorer's safety rules and its life as a server: bad requests answered in one clear line, the
security policy on every response, no request writing to the atlas or escaping it, a replaced atlas
reloaded, loopback by default, and the scanned model checked by fingerprint. Against the real ``kvmem
serve`` in a subprocess; oracles are the atlas's files and plain HTTP."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from explorer_fixtures import atlas_digest, start_server

import kvmem


# ---- bad requests: one clear line, never a traceback ----
@pytest.mark.parametrize("path,status,fragment", [
    ("/neuron/5/0", 404, "layer 5 is not in this atlas"),
    ("/api/neuron/0/96", 404, "neuron 96 is out of range"),
    ("/api/search?by=context&q=(", 400, "bad regular expression"),
    ("/search?by=context&q=(a", 400, "bad regular expression"),
    ("/api/search?page=0", 400, "page must be"),
    ("/api/search?by=nope", 400, "parameter by must be one of"),
    ("/api/search?per_page=x", 400, "per_page must be an integer"),
    ("/api/trace", 400, "give a prompt"),
    ("/api/trace?prompt=hi&edit=9:1=2", 400, "layer 9 is not one of the model's layers"),
    ("/api/trace?prompt=hi&off=0:1&edit=0:1=2", 400, "both switched off and edited"),
    ("/api/trace?prompt=hi&position=99", 400, "out of range"),
    ("/nope", 404, "no page at /nope"),
    ("/api/nope", 404, "no page at /api/nope"),
])
def test_bad_requests_get_a_clear_answer(explorer_server, path, status, fragment):
    explorer_server.wait_model()
    code, headers, body = explorer_server.get(path)
    text = body.decode()
    assert code == status, text[:500]
    assert fragment in (json.loads(text)["error"]["message"] if path.startswith("/api/") else _unescape(text))
    assert "Traceback" not in text and 'File "' not in text


def _unescape(text: str) -> str:
    import html

    return html.unescape(text)


# ---- safety ----
def test_every_response_has_the_policy_and_no_path_escapes(explorer_atlas, explorer_server):
    fingerprint = json.loads((explorer_atlas / "manifest.json").read_text())["model"]["fingerprint"]
    for path in ("/", "/neuron/0/0", "/api/neuron/0/0", "/static/explore.css", "/static/explore.js", "/nope",
                 "/api/search?by=x", "/search?by=all"):
        code, headers, _ = explorer_server.get(path)
        policy = headers["content-security-policy"]
        assert "script-src 'self'" in policy and "default-src 'none'" in policy and "unsafe" not in policy, path
        assert headers["x-content-type-options"] == "nosniff"
    for path in ("/static/../manifest.json", "/static/%2e%2e/manifest.json", "/static/..%2f..%2fmanifest.json",
                 "/static/%2e%2e%2f%2e%2e%2f%2e%2e%2fatlas%2fmanifest.json", "/neuron/..%2f..%2fmanifest.json",
                 "/static/..%5c..%5capp.py", "/static//etc/passwd", "/neuron/0/0/..%2f..%2f..%2fmanifest.json"):
        code, _, body = explorer_server.get(path)
        assert code in (400, 404), path
        assert fingerprint.encode() not in body and b"root:" not in body, path
    code, _, _ = explorer_server.get("/", headers={"Host": "attacker.example"})  # DNS rebinding
    assert code == 400


def test_requests_never_write_to_the_atlas(explorer_atlas, explorer_server):
    before = atlas_digest(explorer_atlas)
    explorer_server.wait_model()
    for path in ("/", "/neuron/0/3", "/api/neuron/1/4", "/search?by=fires&q=the", "/neuron/0/3/report",
                 "/neuron/0/3/export", "/neuron/0/3/export?part=kvmem", "/trace?prompt=The+cat&generate=1&off=0:1",
                 "/api/trace?prompt=x&edit=1:2=3&mode=scale"):
        code, _, _ = explorer_server.get(path)
        assert code == 200, path
    assert explorer_server.get("/reload", method="POST")[0] == 303
    assert atlas_digest(explorer_atlas) == before


def test_replaced_atlas_is_noticed_and_reloaded(explorer_atlas, llama_model, tmp_path):
    served = tmp_path / "served"
    shutil.copytree(explorer_atlas, served)
    server = start_server(served, "--no-model", log=tmp_path / "serve.log")
    try:
        code, first = server.json("/api/neuron/0/1")
        assert code == 200 and len(first["neuron"]["triggers"]["top"]) == 6
        kvmem.scan(llama_model, ["A new corpus, scanned again with other settings. " * 20], out=served, top_k=3,
                   window=32, progress=False, overwrite=True)  # what `kvmem scan --overwrite` does
        code, error = server.json("/api/neuron/0/1")
        assert code == 409 and "changed on disk" in error["error"]["message"]
        code, _, page = server.get("/neuron/0/1")
        assert code == 409 and b'action="/reload"' in page
        code, _, _ = server.get("/reload", method="POST")
        assert code == 303
        code, second = server.json("/api/neuron/0/1")
        assert code == 200 and len(second["neuron"]["triggers"]["top"]) == 3
        assert second["atlas_id"] != first["atlas_id"]
    finally:
        server.stop()
    assert "Traceback" not in server.stderr()


def test_loopback_by_default_and_a_warning_otherwise(explorer_atlas, tmp_path):
    server = start_server(explorer_atlas, "--no-model", "--host", "0.0.0.0", log=tmp_path / "wide.log")
    try:
        assert server.get("/api/status")[0] == 200
    finally:
        server.stop()
    assert "warning: listening on 0.0.0.0" in server.stderr()
    server = start_server(explorer_atlas, "--no-model", log=tmp_path / "local.log")
    try:
        assert server.url.startswith("http://127.0.0.1:")
        code, _, body = server.get("/trace?prompt=hello")  # pages that need the model say so
        assert code == 503 and b"without a model" in body
        assert server.json("/api/trace?prompt=hello")[0] == 503
        assert server.get("/neuron/0/0")[0] == 200
    finally:
        server.stop()
    assert "warning" not in server.stderr()


def test_the_scanned_model_is_fingerprint_checked(explorer_atlas, llama_dir, gpt2_dir, tmp_path):
    from transformers import LlamaForCausalLM

    changed = tmp_path / "changed-model"
    shutil.copytree(llama_dir, changed)
    hf = LlamaForCausalLM.from_pretrained(changed)
    with torch.no_grad():
        hf.model.layers[0].mlp.down_proj.weight[0, 0] += 1.0
    hf.save_pretrained(changed)
    atlas = tmp_path / "atlas"
    shutil.copytree(explorer_atlas, atlas)
    manifest = json.loads((atlas / "manifest.json").read_text())
    manifest["model"]["name"] = str(changed)  # the manifest's model directory, whose weights changed since
    (atlas / "manifest.json").write_text(json.dumps(manifest))
    server = start_server(atlas, log=tmp_path / "a.log")
    try:  # the manifest's model is refused: it would recompute the atlas's numbers with other weights
        model = server.wait_model()
        assert model["state"] == "failed" and "is not the scanned model" in model["message"]
        code, _, page = server.get("/trace?prompt=hello")
        assert code == 503 and b"is not the scanned model" in page
        assert server.get("/neuron/0/0")[0] == 200  # the atlas pages work without it
    finally:
        server.stop()
    server = start_server(explorer_atlas, "--model", str(gpt2_dir), log=tmp_path / "b.log")
    try:  # a model named with --model is the user's choice: used, with a warning on every page
        model = server.wait_model()
        assert model["state"] == "ready" and model["fingerprint_match"] is False
        _, _, page = server.get("/neuron/0/0")
        assert b"is not the scanned model" in page
    finally:
        server.stop()
