"""Run the explorer: in the foreground for ``kvmem serve``, or in a background thread for a notebook.

The socket is bound here, before uvicorn starts, so a port in use is a one-line error and port 0 picks a
free port whose number the URL then names. Listening anywhere but the loopback interface is allowed, with
a warning: the server has no authentication, and the atlas's corpus texts and the model become reachable.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvmem.errors import KvmemError

__all__ = ["Running", "bind", "build", "is_loopback", "serve", "start_in_thread"]

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str) -> str | None:
    """The warning for a server reachable from other machines (None on the loopback interface)."""
    if is_loopback(host):
        return None
    return (f"listening on {host}: anyone who can reach this machine can read the atlas (its corpus texts) and run "
            f"the model; the explorer has no authentication. Use --host 127.0.0.1 (the default) unless you mean it.")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); a one-line KvmemError when the port is taken or the host unknown."""
    if not 0 <= port <= 65535:
        raise KvmemError(f"--port must be 0..65535 (0 picks a free port), got {port}")
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise KvmemError(f"cannot listen on host {host!r} ({error.strerror}); use an address of this machine, "
                         f"e.g. 127.0.0.1") from None
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(info[4])
    except OSError as error:
        sock.close()
        if error.errno in (98, 48):  # EADDRINUSE on Linux, macOS
            raise KvmemError(f"port {port} on {host} is in use; pass --port P (or --port 0 for a free one)") from None
        raise KvmemError(f"cannot listen on {host}:{port} ({error.strerror})") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/"


def build(atlas, *, model: Any = None, device: str = "cpu", load_model: bool = True, host: str = "127.0.0.1"):
    """(app, live model, url) for the atlas at ``atlas`` (a path or an Atlas); ``model``: a model name or directory,
    or a loaded :class:`~kvmem.models.Model`, or None for the manifest's."""
    from kvmem.explorer.app import create_app
    from kvmem.explorer.live import LiveModel
    from kvmem.explorer.snapshot import open_snapshot

    path = getattr(atlas, "path", atlas)
    holder = open_snapshot(path)
    given = model if model is not None and not isinstance(model, (str, os.PathLike)) else None
    spec = str(model) if isinstance(model, (str, os.PathLike)) else None
    live = LiveModel(holder.snapshot.manifest, spec=spec, model=given, device=device, enabled=load_model)
    allowed = ["127.0.0.1", "localhost"] if is_loopback(host) else None
    return create_app(holder, live, allowed_hosts=allowed), live


def _server(app, *, log_level: str):
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off", timeout_graceful_shutdown=2)
    return uvicorn.Server(config)


def serve(atlas, *, host: str = "127.0.0.1", port: int = 8000, model: Any = None, device: str = "cpu",
          load_model: bool = True, out=None) -> int:
    """Serve until interrupted (``kvmem serve``); prints the URL first, then loads the model in the background."""
    out = out or sys.stdout
    started = time.perf_counter()
    warning = exposure_warning(host)
    if warning:
        print(f"kvmem serve: warning: {warning}", file=sys.stderr, flush=True)
    sock = bind(host, port)
    try:
        app, live = build(atlas, model=model, device=device, load_model=load_model, host=host)
    except BaseException:
        sock.close()
        raise
    url = _url(host, sock.getsockname()[1])
    live.start()
    status = {"loading": f"model {live.name} loading in the background", "ready": f"model {live.name} ready",
              "off": "no model (--no-model): the trace page is off"}.get(live.state, live.state)
    print(f"kvmem explorer: serving {app.state.explorer.holder.snapshot.path} at {url} "
          f"(ready in {time.perf_counter() - started:.1f} s; {status}; Ctrl-C stops it)", file=out, flush=True)
    logging.getLogger("kvmem.explorer").addHandler(logging.StreamHandler(sys.stderr))
    server = _server(app, log_level="warning")
    server.run(sockets=[sock])
    return 0


@dataclass
class Running:
    """A server running in a background thread (:func:`start_in_thread`): its URL, and ``stop()``."""

    url: str
    app: Any = field(repr=False)
    server: Any = field(repr=False)
    thread: threading.Thread = field(repr=False)

    @property
    def model(self):
        return self.app.state.explorer.live

    def stop(self, timeout: float = 10) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def _repr_html_(self) -> str:
        from html import escape

        url = escape(self.url, quote=True)
        return (f'<p>kvmem explorer at <a href="{url}" target="_blank">{url}</a> (<code>.stop()</code> ends it)</p>'
                f'<iframe src="{url}" width="100%" height="640" style="border:1px solid #ccc"></iframe>')


def start_in_thread(atlas, *, host: str = "127.0.0.1", port: int = 0, model: Any = None, device: str = "cpu",
                    load_model: bool = True, timeout: float = 30) -> Running:
    """Start the explorer in a daemon thread and return once it answers (for notebooks: ``kvmem.explore``)."""
    import warnings

    warning = exposure_warning(host)
    if warning:
        warnings.warn(warning, stacklevel=3)
    sock = bind(host, port)
    try:
        app, live = build(atlas, model=model, device=device, load_model=load_model, host=host)
    except BaseException:
        sock.close()
        raise
    live.start()
    server = _server(app, log_level="error")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="kvmem-explorer", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise KvmemError("the explorer did not start; run kvmem serve from a shell to see why")
        time.sleep(0.02)
    return Running(url=_url(host, sock.getsockname()[1]), app=app, server=server, thread=thread)
