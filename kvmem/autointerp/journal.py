"""A journal of answered LLM requests, so that a killed run resumes and asks nothing twice.

Each line is ``{"key": sha256 of the request, "answer": text}``, appended and flushed as soon as
the answer arrives. The key covers the backend's identity (URL or path, model name) and the
request (messages, max_tokens, temperature), so a changed prompt or model is asked again.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

__all__ = ["Journal", "request_key"]


def request_key(identity: str, request: dict) -> str:
    text = json.dumps({"backend": identity, "request": request}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


class Journal:
    """Answers by request key, read from ``path`` (a missing or torn last line is ignored) and appended to."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = None if path is None else Path(path)
        self.answers: dict[str, str] = {}
        self._lock = threading.Lock()
        if self.path is not None and self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    self.answers[entry["key"]] = entry["answer"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a line cut by a kill

    def get(self, key: str) -> str | None:
        return self.answers.get(key)

    def put(self, key: str, answer: str) -> None:
        with self._lock:
            self.answers[key] = answer
            if self.path is None:
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as out:
                out.write(json.dumps({"key": key, "answer": answer}, ensure_ascii=False) + "\n")
                out.flush()
                os.fsync(out.fileno())
