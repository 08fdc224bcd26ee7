"""The model behind the trace page: loaded in a background thread, checked against the atlas, used one request at a time.

The server answers atlas pages at once; the model loads beside it (:meth:`LiveModel.start`) and the
pages that need it say "loading" until it is ready. Without ``--model`` the model the manifest names is
loaded (:func:`kvmem.atlas_origin.load_scanned_model`, refused when its fingerprint differs); a model named
with ``--model`` is checked the same way (:func:`kvmem.atlas_origin.check_model`) and, when it differs, used
with a warning on every page that shows its numbers.

Traces and generations run under one lock: edits add hooks for the length of a request
(:func:`kvmem.intervention.intervene`), and two requests must not see each other's edits.
"""

from __future__ import annotations

import math
import threading
import time
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

from kvmem.errors import KvmemError

if TYPE_CHECKING:
    from kvmem.explorer.edits import Edits
    from kvmem.models import Model

__all__ = ["LiveModel", "ModelUnavailable", "trace_view", "MAX_PROMPT_CHARS"]

MAX_PROMPT_CHARS = 4000


class ModelUnavailable(KvmemError):
    """The page needs the model and it is not ready (HTTP 503)."""


class LiveModel:
    """State: ``off`` (no model), ``loading``, ``ready`` or ``failed`` (with the reason)."""

    def __init__(self, manifest, *, spec: str | None = None, model: Model | None = None, device: str = "cpu",
                 enabled: bool = True):
        self.manifest = manifest
        self.spec = spec
        self.device = device
        self.model: Model | None = None
        self.state = "off" if not enabled and model is None else "loading"
        self.message = "started without a model (--no-model)" if self.state == "off" else ""
        self.mismatch: str | None = None
        self.seconds: float | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if model is not None:
            self._accept(model, time.perf_counter())

    @property
    def name(self) -> str:
        if self.model is not None:
            return self.model.name
        return self.spec or str(self.manifest.model["name"])

    def start(self) -> None:
        """Load the model in a daemon thread (nothing to do when it is given or off)."""
        if self.state != "loading" or self.model is not None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._load, name="kvmem-explorer-model", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the load ends (or ``timeout``); return the state."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.state

    def _load(self) -> None:
        from kvmem.atlas_origin import load_scanned_model
        from kvmem.loading import load_model

        start = time.perf_counter()
        try:
            if self.spec is None:
                model = load_scanned_model(self.manifest, device=self.device)
            else:
                model = load_model(self.spec, device=self.device)
        except Exception as error:  # any failure is shown on the pages, in one line
            self.state, self.message = "failed", _one_line(error)
            return
        self._accept(model, start)

    def _accept(self, model: Model, start: float) -> None:
        from kvmem.atlas_origin import check_model

        try:
            check_model(self.manifest, model)
        except KvmemError as error:
            self.mismatch = f"{error}: the trace uses other weights than the atlas's numbers"
        self.model = model
        self.seconds = time.perf_counter() - start
        self.state, self.message = "ready", ""

    def status(self) -> dict:
        return {"state": self.state, "model": self.name, "message": self.message or None,
                "fingerprint_match": None if self.model is None else self.mismatch is None,
                "warning": self.mismatch, "load_seconds": self.seconds,
                "device": str(self.model.device) if self.model is not None else self.device}

    @contextmanager
    def use(self):
        """The model, held for this request; :class:`ModelUnavailable` when it is not ready."""
        if self.state != "ready":
            reason = {"off": "this server runs without a model (started with --no-model)",
                      "loading": f"the model {self.name} is still loading; this page works once it is ready",
                      "failed": f"the model {self.name} could not be loaded: {self.message}"}[self.state]
            raise ModelUnavailable(reason)
        with self._lock:
            yield self.model


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text and not isinstance(error, KvmemError) else (
        text[0] if text else type(error).__name__)


def _number(value) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _next_tokens(model: Model, ids: list[int], position: int, k: int = 10) -> list[dict]:
    """The model's own top-k next tokens at ``position``: a plain forward of the HF model (no kvmem hook)."""
    import torch

    with torch.no_grad():
        logits = model.hf_model(torch.tensor([ids], device=model.device)).logits[0, position].float()  # [vocab]
    probs = logits.softmax(-1)
    top = probs.topk(k)
    return [{"token": model.token_str(int(i)), "token_id": int(i), "prob": _number(p), "logit": _number(logits[i])}
            for p, i in zip(top.values.tolist(), top.indices.tolist())]


@contextmanager
def _edited(model: Model, edits: Edits):
    from kvmem.intervention import intervene

    with ExitStack() as stack:
        if edits.off:
            stack.enter_context(intervene(model, {pair: 0.0 for pair in edits.off}, mode="set"))
        if edits.edits:
            stack.enter_context(intervene(model, dict(edits.edits), mode=edits.mode))
        yield


def trace_view(model: Model, prompt: str, *, position: int, top: int, convention: str, prepend_bos: bool,
               edits: Edits, generate: bool, max_new_tokens: int) -> dict[str, Any]:
    """One trace as plain data: the prompt's tokens, per layer the logit lens and the heaviest sub-updates
    (:func:`kvmem.tracing.trace`), the model's own next tokens, and, when asked or edited, the greedy
    continuation without and with the edits."""
    from kvmem.intervention import greedy_continuation
    from kvmem.tracing import trace

    if not prompt:
        raise KvmemError("type a prompt to trace")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise KvmemError(f"the prompt has {len(prompt):,} characters; at most {MAX_PROMPT_CHARS:,}")
    started = time.perf_counter()
    result = trace(model, prompt, position=position, top=top, convention=convention, n_tokens=3,
                   prepend_bos=prepend_bos)
    attrs = result.attrs
    ids, pos = list(attrs["token_ids"]), int(attrs["position"])
    layers = [{key: (_number(v) if isinstance(v, float) else v.item() if hasattr(v, "item") else v)
               for key, v in row.items()} for row in result.layers.to_dict("records")]
    updates: dict[int, list[dict]] = {}
    for row in result.sub_updates.to_dict("records"):
        entry = {key: (_number(v) if isinstance(v, float) else v.item() if hasattr(v, "item") else v)
                 for key, v in row.items()}
        for key in ("update_tokens", "value_tokens"):
            if key in entry:
                entry[key] = [str(t) for t in entry[key]]
        updates.setdefault(int(row["layer"]), []).append(entry)
    out: dict[str, Any] = {
        "prompt": prompt, "tokens": list(attrs["tokens"]), "token_ids": ids, "position": pos,
        "position_token": attrs["position_token"], "final_token": attrs["final_token"],
        "final_token_id": int(attrs["final_token_id"]), "convention": attrs["convention"],
        "convention_formula": attrs["convention_formula"], "logit_lens": attrs["logit_lens"],
        "residual_before": attrs["residual_before"], "prepend_bos": bool(attrs.get("prepend_bos", prepend_bos)),
        "top": top, "model": attrs["model"], "fingerprint": attrs["fingerprint"],
        "kvmem_version": attrs["kvmem_version"], "layers": layers,
        "sub_updates": [{"layer": layer, "rows": rows} for layer, rows in sorted(updates.items())],
        "next_tokens": _next_tokens(model, ids, pos), "edits": edits.to_dict(),
    }
    if edits:
        with _edited(model, edits):
            out["next_tokens_edited"] = _next_tokens(model, ids, pos)
    if generate or edits:
        plain = greedy_continuation(model, prompt, max_new_tokens=max_new_tokens, prepend_bos=prepend_bos)
        generation = {"max_new_tokens": max_new_tokens, "without": plain}
        if edits:
            with _edited(model, edits):
                generation["with"] = greedy_continuation(model, prompt, max_new_tokens=max_new_tokens,
                                                         prepend_bos=prepend_bos)
            generation["changed"] = generation["with"] != plain
        out["generation"] = generation
    out["seconds"] = time.perf_counter() - started
    return out
