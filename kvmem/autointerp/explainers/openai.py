"""The ``openai:URL`` backend: any OpenAI-compatible chat endpoint (vLLM, llama.cpp, ``transformers serve``, hosted).

``URL`` is the API base (``http://host:port/v1``; ``/chat/completions`` is appended unless the URL
already ends with it). The model name is an option (``--model-name``), the key comes from an
environment variable (``OPENAI_API_KEY`` unless told otherwise; none is sent when it is unset).
Requests go out ``concurrency`` at a time; each has a ``timeout`` and is retried ``retries`` times
with exponential backoff (``backoff * 2**attempt`` seconds) on a timeout, a refused connection or
a 429/5xx answer. Every answer is written to the journal the moment it arrives, so a killed run
resumes without asking again; a request that still fails raises one line naming the URL, after
the answers already received have been kept.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvmem.autointerp.journal import Journal, request_key
from kvmem.errors import KvmemError

__all__ = ["OpenAIBackend"]

RETRY_STATUS = (408, 409, 425, 429, 500, 502, 503, 504)


@dataclass(kw_only=True)
class OpenAIBackend:
    url: str
    model: str = "default"
    api_key_env: str = "OPENAI_API_KEY"
    timeout: float = 60.0
    retries: int = 3
    backoff: float = 1.0
    concurrency: int = 4
    temperature: float = 0.0
    journal: Journal = field(default_factory=lambda: Journal(None))
    asked: int = 0  # requests sent to the server by this object (journal hits excluded)

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise KvmemError(f"openai endpoint must be an http(s) URL such as http://localhost:8000/v1, got {self.url!r}")
        if self.concurrency < 1 or self.retries < 0 or self.timeout <= 0:
            raise KvmemError(f"openai backend needs concurrency >= 1, retries >= 0 and timeout > 0, got "
                             f"{self.concurrency}, {self.retries}, {self.timeout}")
        base = self.url.rstrip("/")
        self.endpoint = base if base.endswith("/chat/completions") else base + "/chat/completions"

    @property
    def fingerprint(self) -> str:
        return f"{self.endpoint}#{self.model}"

    def chat(self, requests: list[dict]) -> list[str]:
        """Answers to ``requests`` ({messages, max_tokens}) in order; journal hits are not sent again."""
        bodies = [{"model": self.model, "messages": r["messages"], "max_tokens": int(r.get("max_tokens", 64)),
                   "temperature": self.temperature} for r in requests]
        keys = [request_key(self.fingerprint, body) for body in bodies]
        answers: list[str | None] = [self.journal.get(k) for k in keys]
        todo = [i for i, a in enumerate(answers) if a is None]
        errors: list[KvmemError] = []

        def ask(i: int) -> None:
            if errors:  # one request failed for good: send no more, keep what arrived
                return
            try:
                answers[i] = self._ask(bodies[i])
            except KvmemError as error:
                errors.append(error)
                return
            self.journal.put(keys[i], answers[i])  # type: ignore[arg-type]

        if todo:
            with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
                list(pool.map(ask, todo))
        if errors:
            raise errors[0]
        return answers  # type: ignore[return-value]

    def _ask(self, body: dict) -> str:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(self.endpoint, data=data, headers=headers, method="POST")
            try:
                self.asked += 1
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    reply = json.loads(response.read().decode("utf-8"))
                return _content(reply, self.endpoint)
            except urllib.error.HTTPError as error:
                last = f"HTTP {error.code} {error.reason}"
                if error.code not in RETRY_STATUS:
                    break
            except TimeoutError:
                last = f"no answer within {self.timeout:g} s"
            except urllib.error.URLError as error:
                reason = error.reason
                last = f"no answer within {self.timeout:g} s" if isinstance(reason, (TimeoutError, socket.timeout)) \
                    else f"cannot connect ({reason})"
            except (ConnectionError, OSError) as error:
                last = f"connection failed ({error})"
        raise KvmemError(f"openai endpoint {self.endpoint} failed after {attempt + 1} attempt(s): {last}; check the "
                         f"server and --model-name (answers received so far are kept and not asked again)")


def _content(reply: dict, endpoint: str) -> str:
    try:
        content = reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise KvmemError(f"openai endpoint {endpoint} answered without choices[0].message.content; "
                         f"is it an OpenAI-compatible chat endpoint?") from None
    return content or ""
