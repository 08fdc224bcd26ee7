"""The token side of a :class:`~kvmem.models.Model`: the ids a scan and a prompt read, and the text of ids.

:class:`ModelTokens` is a mixin of :class:`~kvmem.models.Model`; it reads the model's ``tokenizer``, ``name``,
``n_ctx`` and ``vocab_size`` and nothing else of it.
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property

from kvmem.builtin import SCAN_BOS
from kvmem.errors import KvmemError

__all__ = ["ModelTokens"]


class ModelTokens:
    """Token ids and texts of a model (mixed into :class:`~kvmem.models.Model`)."""

    tokenizer: object
    name: str
    n_ctx: int
    vocab_size: int

    @cached_property
    def bos_token_id(self) -> int | None:
        """The token a scanned window starts with: the tokenizer's BOS, unless :data:`kvmem.builtin.SCAN_BOS`
        names a better one for this built-in model."""

        if self.name in SCAN_BOS:
            return int(self.tokenizer.convert_tokens_to_ids(SCAN_BOS[self.name]))
        return self.tokenizer.bos_token_id

    def prompt_ids(self, prompt: str | list[int], *, prepend_bos: bool | None = None) -> list[int]:
        """The ids the model reads for a prompt: its tokens (text is encoded without special tokens), after
        :attr:`bos_token_id` as a scan reads every window, unless ``prepend_bos`` is False (None: BOS where
        the tokenizer has one; True: BOS, or an error where it has none). Checked against the context."""
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise KvmemError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise KvmemError("the prompt has no tokens; pass a non-empty prompt")
        if prepend_bos and self.bos_token_id is None:
            raise KvmemError(f"prepend_bos=True but the tokenizer of {self.name} has no BOS token; pass "
                             f"prepend_bos=False")
        if prepend_bos is not False and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        if self.n_ctx and len(ids) > self.n_ctx:
            raise KvmemError(f"the prompt is {len(ids)} tokens, more than the model's context of {self.n_ctx}; "
                             f"shorten it")
        return ids

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def token_str(self, token_id: int) -> str:
        """The text of one token (decoded, so GPT-2's 'Ġ' shows as a space)."""
        return self.tokenizer.decode([int(token_id)])

    @cached_property
    def vocab_strings(self) -> list[str]:
        """Decoded text of every token id [vocab] (ids past the tokenizer's vocabulary show as '<id N>')."""
        return self.token_texts(range(self.vocab_size))

    def token_texts(self, token_ids) -> list[str]:
        """Decoded text of each id in ``token_ids`` (as :attr:`vocab_strings` has it), decoding each distinct
        id once: a scan's contexts need a few thousand of a vocabulary's tens of thousands."""
        if "vocab_strings" in self.__dict__:  # already decoded whole
            vocab = self.vocab_strings
            return [vocab[i] for i in token_ids]
        ids = [int(i) for i in token_ids]
        distinct = sorted(set(ids))
        known = [i for i in distinct if i < len(self.tokenizer)]
        text = dict(zip(known, self.tokenizer.batch_decode([[i] for i in known])))
        return [text[i] if i in text else f"<id {i}>" for i in ids]

    @cached_property
    def vocab_digest(self) -> str:
        """sha256 naming :attr:`vocab_strings` without decoding them: a fast tokenizer's whole definition
        (vocabulary, merges, normaliser, decoder) with the settings decode reads; otherwise the strings."""
        import transformers

        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            text = "\0".join(self.vocab_strings)
        else:
            text = json.dumps({"tokenizer": backend.to_str(), "class": type(self.tokenizer).__name__,
                               "clean_up": getattr(self.tokenizer, "clean_up_tokenization_spaces", None),
                               "size": len(self.tokenizer), "vocab_size": self.vocab_size,
                               "transformers": transformers.__version__}, sort_keys=True)
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
