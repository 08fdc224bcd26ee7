"""The explorer's web application (Starlette): pages, their JSON twins under ``/api``, and the safety rules.

Routes (``docs/explorer.md`` documents each parameter and field)::

    /                               the atlas at a glance          /api/atlas
    /neuron/{layer}/{neuron}        one neuron                     /api/neuron/{layer}/{neuron}
    /neuron/{layer}/{neuron}/report the static HTML report (kvmem report), /export the neuron-explainer record
    /search                         neurons by token, pattern, class or score   /api/search
    /trace                          a prompt's memories, edits and generation   /api/trace
    /api/status                     the atlas and model state      POST /reload: reopen a changed atlas
    /static/...                     the package's CSS and script

Every response carries a Content-Security-Policy that allows only the package's own script and style
files (no inline script, no other origin). Requests never write to the atlas; a request answered while
the atlas changed on disk is refused (:class:`~kvmem.explorer.snapshot.AtlasChanged`, HTTP 409). Errors
are one clear line in a page or a JSON object (``{"error": {"status", "kind", "message"}}``), never a
traceback (the server logs those).
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from kvmem.errors import KvmemError
from kvmem.explorer.edits import parse_edits
from kvmem.explorer.live import LiveModel, ModelUnavailable, trace_view
from kvmem.explorer.neuron_view import QUADRANTS, context_cells, neuron_record, neuron_view, scale_of
from kvmem.explorer.render import environment
from kvmem.explorer.search import BY, SORTS, Query, run_search
from kvmem.explorer.search_index import SearchIndex
from kvmem.explorer.snapshot import SCORERS, TAXONOMY_FLAGS, AtlasChanged, Holder, NotFound
from kvmem.explorer.svg import histogram, layer_lines

__all__ = ["create_app", "Explorer", "CSP"]

log = logging.getLogger("kvmem.explorer")

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "form-action 'self'; base-uri 'none'; frame-ancestors 'self' http://localhost:* http://127.0.0.1:*")
REPORT_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"
SECURITY_HEADERS = {"content-security-policy": CSP, "x-content-type-options": "nosniff",
                    "referrer-policy": "no-referrer", "cache-control": "no-store"}
STATUS = {AtlasChanged: 409, NotFound: 404, ModelUnavailable: 503}


class Explorer:
    """The served state: the atlas snapshot (replaced whole on reload), its search index, and the model."""

    def __init__(self, holder: Holder, live: LiveModel):
        self.holder = holder
        self.live = live
        self.env = environment()
        self._index: SearchIndex | None = None
        self._index_for: str | None = None
        self._lock = threading.Lock()
        self.started = time.time()

    def current(self):
        """(snapshot, index) of the atlas being served; the index is built in a background thread."""
        snapshot = self.holder.snapshot
        with self._lock:
            if self._index_for != snapshot.id:
                self._index, self._index_for = SearchIndex(snapshot), snapshot.id
                threading.Thread(target=_warm, args=(snapshot, self._index), name="kvmem-explorer-warm",
                                 daemon=True).start()
            return snapshot, self._index

    def page(self, name: str, request: Request, snapshot, status: int = 200, **context) -> HTMLResponse:
        from kvmem import __version__

        text = self.env.get_template(name).render(request=request, snapshot=snapshot, model=self.live.status(),
                                                  version=__version__, params=request.query_params, status=status,
                                                  **context)
        return HTMLResponse(text, status_code=status)


def _warm(snapshot, index: SearchIndex) -> None:
    """Read the slower parts of the atlas ahead of the first pages (in a background thread); a failure is left
    for the page that needs the part to report."""
    try:
        snapshot.warm()
        index.build_all()
    except Exception:  # noqa: BLE001 - reported by the pages that need it
        log.debug("kvmem explorer: warming the atlas failed", exc_info=True)


def _consistent(snapshot, build):
    """``build()`` with the atlas checked before and after, so no answer mixes two versions of it."""
    snapshot.check()
    result = build()
    snapshot.check()
    return result


def _wants_json(request: Request) -> bool:
    """JSON routes (``/api/...``, a neuron's export) and clients that ask for JSON get errors as JSON."""
    accept = request.headers.get("accept", "")
    return (request.url.path.startswith("/api/") or request.url.path.endswith("/export")
            or ("application/json" in accept and "text/html" not in accept))


def _json(data: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(_finite(data), status_code=status)


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if hasattr(value, "item"):  # numpy scalars
        return _finite(value.item())
    return value


# ---- parameters ----
def _int(request: Request, name: str, default: int | None, low: int | None = None, high: int | None = None) -> int | None:
    text = request.query_params.get(name, "")
    if text.strip() == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise KvmemError(f"parameter {name} must be an integer, got {text!r}") from None
    if (low is not None and value < low) or (high is not None and value > high):
        raise KvmemError(f"parameter {name} must be in {low}..{high}, got {value}")
    return value


def _float(request: Request, name: str) -> float | None:
    text = request.query_params.get(name, "")
    if text.strip() == "":
        return None
    try:
        value = float(text)
    except ValueError:
        raise KvmemError(f"parameter {name} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise KvmemError(f"parameter {name} must be a finite number, got {text!r}")
    return value


def _choice(request: Request, name: str, choices, default: str | None) -> str | None:
    value = request.query_params.get(name, "") or default
    if value is not None and value not in choices:
        raise KvmemError(f"parameter {name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _query(request: Request) -> Query:
    return Query(q=request.query_params.get("q", ""), by=_choice(request, "by", BY, "all"),
                 layer=_int(request, "layer", None), side=_choice(request, "side", ("top", "bottom"), "top"),
                 convention=request.query_params.get("convention") or None,
                 taxonomy=_choice(request, "class", TAXONOMY_FLAGS, None),
                 scorer=_choice(request, "scorer", SCORERS, "detection"), score_min=_float(request, "score_min"),
                 score_max=_float(request, "score_max"), sort=_choice(request, "sort", SORTS, None),
                 order=_choice(request, "order", ("asc", "desc"), None), page=_int(request, "page", 1, 1),
                 per_page=_int(request, "per_page", 50, 1, 500))


# ---- pages and their JSON ----
def _overview(explorer: Explorer, snapshot) -> dict:
    m = snapshot.manifest
    files = sorted((p.name, p.stat().st_size) for p in snapshot.path.iterdir() if p.is_file() and not p.name.startswith("."))
    return {"atlas_id": snapshot.id, "path": str(snapshot.path), "manifest": m.to_dict(),
            "neurons": snapshot.n_neurons, "files": [{"name": n, "bytes": b} for n, b in files],
            "layers": snapshot.summary.__dict__, "taxonomy": snapshot.taxonomy is not None,
            "explanations": int(len(snapshot.explanations)), "model": explorer.live.status()}


def _charts(summary) -> list[dict]:
    charts = [{"title": "Activation density", "svg": layer_lines(
        summary.layers, {"median": summary.density["median"]}, band=(summary.density["q25"], summary.density["q75"]),
        label="share of positions with m > 0"),
        "caption": "Share of positions with m > 0 per neuron: the layer's median, its quartiles shaded."}]
    if summary.norms:
        names = {"key_norm": "‖k‖", "gate_norm": "‖g‖", "value_norm": "‖w‖"}
        charts.append({"title": "Vector norms", "svg": layer_lines(
            summary.layers, {names[k]: v for k, v in summary.norms.items()}, label="median norm"),
            "caption": "Median key (up), gate and written-value norm of the layer's neurons."})
    if summary.classes:
        charts.append({"title": "Taxonomy classes", "svg": layer_lines(
            summary.layers, {k: [float(c) for c in v] for k, v in summary.classes.items() if any(v)} or
            {k: [float(c) for c in v] for k, v in list(summary.classes.items())[:1]}, label="neurons"),
            "caption": "Neurons of each class per layer (kvmem taxonomy); classes with none are left out."})
    if summary.scores:
        charts.append({"title": "Explanation scores", "svg": layer_lines(summary.layers, summary.scores, label="score"),
                       "caption": "Mean score of the layer's scored explanations, per scorer (balanced accuracy for "
                                  "detection and fuzzing, chance 0.5; Pearson r for simulation)."})
    return charts


def create_app(holder: Holder, live: LiveModel, *, allowed_hosts: list[str] | None = None) -> Starlette:
    """The ASGI application serving ``holder``'s atlas and ``live``'s model. ``allowed_hosts``: the Host headers
    accepted (the server's own loopback names when it listens on 127.0.0.1, which stops DNS rebinding)."""
    explorer = Explorer(holder, live)
    explorer.current()

    def overview(request: Request) -> Response:
        snapshot, _ = explorer.current()
        data = _consistent(snapshot, lambda: _overview(explorer, snapshot))
        return explorer.page("index.html", request, snapshot, data=data, charts=_charts(snapshot.summary))

    def api_atlas(request: Request) -> Response:
        snapshot, _ = explorer.current()
        return _json(_consistent(snapshot, lambda: _overview(explorer, snapshot)))

    def neuron_jump(request: Request) -> Response:
        snapshot, _ = explorer.current()
        layer, neuron = _int(request, "layer", None), _int(request, "neuron", None)
        if layer is None or neuron is None:
            raise KvmemError("give a layer and a neuron (e.g. /neuron?layer=3&neuron=17)")
        snapshot.check_neuron(layer, neuron)
        return RedirectResponse(f"/neuron/{layer}/{neuron}", status_code=303)

    def neuron_page(request: Request) -> Response:
        snapshot, _ = explorer.current()
        layer, neuron = request.path_params["layer"], request.path_params["neuron"]
        view = _consistent(snapshot, lambda: neuron_view(snapshot, layer, neuron, explorer.live))
        scale = scale_of(view)
        data = view["neuron"]
        shaded = {kind: [context_cells(t, scale) for t in rows] for kind, rows in data["triggers"].items()}
        quantiles = [[context_cells(s, scale) for s in band["samples"]] for band in data["quantiles"]]
        randoms = [context_cells(s, scale) for s in view["random_samples"]]
        return explorer.page("neuron.html", request, snapshot, view=view, data=data, shaded=shaded,
                             quantile_cells=quantiles, random_cells=randoms, quadrant_labels=QUADRANTS,
                             histogram_svg=histogram(data["histogram"]["edges"], data["histogram"]["counts"]))

    def api_neuron(request: Request) -> Response:
        snapshot, _ = explorer.current()
        layer, neuron = request.path_params["layer"], request.path_params["neuron"]
        return _json(_consistent(snapshot, lambda: neuron_view(snapshot, layer, neuron, explorer.live)))

    def report(request: Request) -> Response:
        from kvmem.report.figures import neuron_figures
        from kvmem.report.html import render_neuron
        from kvmem.report.neuron_dict import neuron_data

        snapshot, _ = explorer.current()
        layer, neuron = request.path_params["layer"], request.path_params["neuron"]
        snapshot.check_neuron(layer, neuron)

        def build() -> str:
            record, _ = neuron_record(snapshot, layer, neuron, explorer.live)
            data = neuron_data(snapshot.atlas, layer, neuron, record=record)
            return render_neuron(data, neuron_figures(record, data))

        response = HTMLResponse(_consistent(snapshot, build))
        response.headers["content-security-policy"] = REPORT_CSP
        return response

    def export(request: Request) -> Response:
        from kvmem.export.neuron_explainer import write

        snapshot, _ = explorer.current()
        layer, neuron = request.path_params["layer"], request.path_params["neuron"]
        snapshot.check_neuron(layer, neuron)
        part = _choice(request, "part", ("record", "kvmem"), "record")
        if not snapshot.manifest.scan.get("context_activations", True):
            raise KvmemError("this atlas stores no context coefficients, so its neuron-explainer records need the model; "
                             "export them with: kvmem export")

        def build() -> dict:
            with tempfile.TemporaryDirectory(prefix="kvmem-explorer-") as folder:
                write(snapshot.atlas, Path(folder), [(layer, neuron)], quantiles=False)
                sub = "neurons" if part == "record" else "kvmem"
                return json.loads((Path(folder) / sub / str(layer) / f"{neuron}.json").read_text(encoding="utf-8"))

        response = _json(_consistent(snapshot, build))
        response.headers["content-disposition"] = f'inline; filename="L{layer}_N{neuron}_{part}.json"'
        return response

    def search_page(request: Request) -> Response:
        snapshot, index = explorer.current()
        query = _query(request)
        result = None
        if request.query_params:
            result = _consistent(snapshot, lambda: run_search(index, query))
        return explorer.page("search.html", request, snapshot, query=query, result=result, by=BY, sorts=SORTS,
                             flags=TAXONOMY_FLAGS, scorers=SCORERS)

    def api_search(request: Request) -> Response:
        snapshot, index = explorer.current()
        query = _query(request)
        return _json(_consistent(snapshot, lambda: run_search(index, query)))

    def _trace(request: Request, snapshot) -> dict | None:
        params = request.query_params
        prompt = params.get("prompt", "")
        if not prompt:
            return None
        conventions = snapshot.atlas.conventions
        convention = _choice(request, "convention", conventions, snapshot.atlas.default_convention)
        bos_default = bool(snapshot.manifest.tokenization.get("prepend_bos", False))
        bos = _choice(request, "bos", ("0", "1"), "1" if bos_default else "0") == "1"
        position = _int(request, "position", -1)
        top = _int(request, "top", 5, 1, 50)
        max_new = _int(request, "max_new_tokens", 20, 1, 100)
        generate = _choice(request, "generate", ("0", "1"), "0") == "1"
        edit_texts = [piece for text in params.getlist("edit") for piece in text.replace(",", " ").split() if piece]
        with explorer.live.use() as model:
            edits = parse_edits(params.getlist("off"), edit_texts, params.get("mode") or None,
                                layers=list(range(model.n_layers)), d_ff=model.d_ff)
            return trace_view(model, prompt, position=position, top=top, convention=convention, prepend_bos=bos,
                              edits=edits, generate=generate, max_new_tokens=max_new)

    def trace_page(request: Request) -> Response:
        snapshot, _ = explorer.current()
        result, error = None, None
        try:
            result = _trace(request, snapshot)
        except ModelUnavailable as problem:
            error = str(problem)
        return explorer.page("trace.html", request, snapshot, result=result, model_error=error,
                             status=503 if error and request.query_params.get("prompt") else 200)

    def api_trace(request: Request) -> Response:
        snapshot, _ = explorer.current()
        result = _trace(request, snapshot)
        if result is None:
            raise KvmemError("give a prompt to trace (prompt=...)")
        return _json(result)

    def api_status(request: Request) -> Response:
        snapshot, index = explorer.current()
        try:
            snapshot.check()
            changed = None
        except AtlasChanged as problem:
            changed = str(problem)
        return _json({"atlas": {"id": snapshot.id, "path": str(snapshot.path), "opened_at": snapshot.opened_at,
                                "changed": changed, "index_seconds": dict(index.build_seconds)},
                      "model": explorer.live.status()})

    def reload(request: Request) -> Response:
        holder.reload()
        explorer.current()
        return RedirectResponse("/", status_code=303)

    async def error(request: Request, problem: Exception) -> Response:
        if isinstance(problem, HTTPException):
            status, message = problem.status_code, (problem.detail if problem.status_code != 404 else
                                                    f"no page at {request.url.path}; see / for the atlas, /search and "
                                                    f"/trace")
        elif isinstance(problem, KvmemError):
            status, message = next((s for kind, s in STATUS.items() if isinstance(problem, kind)), 400), str(problem)
        else:
            log.exception("kvmem explorer: %s %s failed", request.method, request.url.path)
            status, message = 500, f"the server failed on this request ({type(problem).__name__}); see its log"
        kind = type(problem).__name__
        if _wants_json(request):
            response = _json({"error": {"status": status, "kind": kind, "message": message}}, status)
        else:
            try:
                response = explorer.page("error.html", request, holder.snapshot, status=status, message=message,
                                         kind=kind, changed=isinstance(problem, AtlasChanged))
            except Exception:  # the page itself failed: say it in plain text
                log.exception("kvmem explorer: the error page failed")
                response = PlainTextResponse(f"{status}: {message}\n", status_code=status)
        response.headers.update(SECURITY_HEADERS)  # the 500 handler runs outside the middleware
        return response

    static = resources.files("kvmem.explorer").joinpath("static")
    routes = [
        Route("/", overview), Route("/api/atlas", api_atlas), Route("/neuron", neuron_jump),
        Route("/neuron/{layer:int}/{neuron:int}", neuron_page), Route("/api/neuron/{layer:int}/{neuron:int}", api_neuron),
        Route("/neuron/{layer:int}/{neuron:int}/report", report), Route("/neuron/{layer:int}/{neuron:int}/export", export),
        Route("/search", search_page), Route("/api/search", api_search),
        Route("/trace", trace_page), Route("/api/trace", api_trace),
        Route("/api/status", api_status), Route("/reload", reload, methods=["POST"]),
        Mount("/static", StaticFiles(directory=str(static)), name="static"),
    ]
    middleware = [Middleware(SecurityHeaders)]
    if allowed_hosts:
        middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts))
    app = Starlette(routes=routes, middleware=middleware, exception_handlers={
        Exception: error, KvmemError: error, HTTPException: error})
    app.state.explorer = explorer
    return app


class SecurityHeaders:
    """ASGI middleware: the Content-Security-Policy and the other protective headers on every response
    (a route may set its own policy first, as the static report does), and ``Server-Timing: app;dur=MS``, the
    time the application took to answer (``benchmarks/explorer.py`` reads it)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        started = time.perf_counter()

        async def with_headers(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((b"server-timing", f"app;dur={(time.perf_counter() - started) * 1000:.2f}".encode()))
                names = {name.lower() for name, _ in headers}
                for name, value in SECURITY_HEADERS.items():
                    if name.encode() not in names:
                        headers.append((name.encode(), value.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)
