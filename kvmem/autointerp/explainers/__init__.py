"""The explainers (and the judges built on the same backends), registered by spec prefix.

A spec is ``tokens``, ``hf:PATH_OR_ID`` or ``openai:URL`` (``kvmem explain --explainer``,
``kvmem score --judge``). Each registry entry builds the explainer, or the judge, from the part
after the colon and the shared :class:`BackendOptions`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvmem.autointerp.explainers.hf import HFBackend
from kvmem.autointerp.explainers.llm import LLMExplainer
from kvmem.autointerp.explainers.openai import OpenAIBackend
from kvmem.autointerp.explainers.tokens import TokensExplainer
from kvmem.autointerp.journal import Journal
from kvmem.autointerp.judges import LLMJudge, TokensJudge
from kvmem.errors import KvmemError

__all__ = ["BackendOptions", "EXPLAINERS", "get_explainer", "get_judge", "make_backend"]


@dataclass(frozen=True, kw_only=True)
class BackendOptions:
    """model_name: the model an openai endpoint serves;  api_key_env: where its key is;  timeout (s), retries,
    backoff (s), concurrency: of openai requests;  batch_size, device: of hf generation;  journal: answers file."""

    model_name: str = "default"
    api_key_env: str = "OPENAI_API_KEY"
    timeout: float = 60.0
    retries: int = 3
    backoff: float = 1.0
    concurrency: int = 4
    batch_size: int = 8
    device: str | None = None
    journal: str | None = None


def _openai(arg: str, options: BackendOptions):
    return OpenAIBackend(url=arg, model=options.model_name, api_key_env=options.api_key_env, timeout=options.timeout,
                         retries=options.retries, backoff=options.backoff, concurrency=options.concurrency,
                         journal=Journal(options.journal))


def _hf(arg: str, options: BackendOptions):
    return HFBackend(path=arg, batch_size=options.batch_size, device=options.device, journal=Journal(options.journal))


# prefix -> backend builder (None: no backend, the built-in tokens explainer / judge)
EXPLAINERS: dict[str, Callable | None] = {"tokens": None, "hf": _hf, "openai": _openai}


def _split(spec: str) -> tuple[str, str]:
    prefix, _, arg = spec.partition(":")
    if prefix not in EXPLAINERS or (EXPLAINERS[prefix] is None) != (arg == ""):
        raise KvmemError(f"unknown explainer {spec!r}; use tokens, hf:PATH_OR_ID or openai:URL")
    return prefix, arg


def make_backend(spec: str, options: BackendOptions | None = None):
    prefix, arg = _split(spec)
    builder = EXPLAINERS[prefix]
    return None if builder is None else builder(arg, options or BackendOptions())


def get_explainer(spec: str = "tokens", options: BackendOptions | None = None):
    backend = make_backend(spec, options)
    return TokensExplainer() if backend is None else LLMExplainer(backend=backend, name=spec)


def get_judge(spec: str = "tokens", options: BackendOptions | None = None):
    backend = make_backend(spec, options)
    return TokensJudge() if backend is None else LLMJudge(backend=backend, name=spec)
