"""The ``hf:PATH_OR_ID`` backend: a local instruct model through transformers, prompted with its chat template.

``PATH_OR_ID``: a kvmem built-in name (``smollm2-135m``: SmolLM2-135M-Instruct, offline), a local
model directory or a hub id, loaded with :func:`kvmem.load_model` (so its fingerprint is the
weights' sha256). Requests are answered greedily (no sampling), ``batch_size`` at a time, left
padded; every answer is journaled as it is produced (:mod:`kvmem.autointerp.journal`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmem.autointerp.journal import Journal, request_key
from kvmem.errors import KvmemError

__all__ = ["HFBackend"]


@dataclass(kw_only=True)
class HFBackend:
    path: str
    batch_size: int = 8
    device: str | None = None
    journal: Journal = field(default_factory=lambda: Journal(None))
    asked: int = 0

    def __post_init__(self) -> None:
        self._loaded = None

    def _load(self):
        if self._loaded is None:
            from kvmem.loading import load_model

            model = load_model(self.path, device=self.device or "cpu")
            tokenizer = model.tokenizer
            if not getattr(tokenizer, "chat_template", None):
                raise KvmemError(f"model {self.path} has no chat template; the hf: explainer needs an instruct model "
                                 f"(e.g. hf:smollm2-135m)")
            self._loaded = model
        return self._loaded

    @property
    def model(self) -> str:
        return self._load().name

    @property
    def fingerprint(self) -> str:
        return self._load().fingerprint

    def chat(self, requests: list[dict]) -> list[str]:
        """Answers to ``requests`` ({messages, max_tokens}) in order; journal hits are not generated again."""
        identity = f"hf:{self.fingerprint}"
        keys = [request_key(identity, {"messages": r["messages"], "max_tokens": int(r.get("max_tokens", 64))})
                for r in requests]
        answers: list[str | None] = [self.journal.get(k) for k in keys]
        todo = [i for i, a in enumerate(answers) if a is None]
        for begin in range(0, len(todo), self.batch_size):
            part = todo[begin:begin + self.batch_size]
            for i, text in zip(part, self._generate([requests[i] for i in part])):
                answers[i] = text
                self.journal.put(keys[i], text)
        return answers  # type: ignore[return-value]

    def _generate(self, requests: list[dict]) -> list[str]:
        import torch

        model = self._load()
        tokenizer, hf = model.tokenizer, model.hf_model
        prompts = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
                   for r in requests]
        side, pad = tokenizer.padding_side, tokenizer.pad_token_id
        tokenizer.padding_side = "left"
        if pad is None:
            tokenizer.pad_token = tokenizer.eos_token
        try:
            batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(hf.device)
        finally:
            tokenizer.padding_side = side
        new = max(int(r.get("max_tokens", 64)) for r in requests)
        with torch.no_grad():
            output = hf.generate(**batch, max_new_tokens=new, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        self.asked += len(requests)
        width = batch["input_ids"].shape[1]
        return [tokenizer.decode(row[width:], skip_special_tokens=True).strip() for row in output]
