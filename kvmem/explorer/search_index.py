"""Search indexes over an atlas, built by streaming its tables one row group at a time.

The explorer never holds a whole triggers, samples or values table. It keeps compact arrays instead:

- values: per (convention, kind), one entry per kept projected token: token id (sorted), neuron, rank
  and score (14 bytes a row), so "which neurons promote ' Paris'" is a binary search;
- triggers (top and bottom kinds): neuron, side, rank, coefficient and the row of its position in a
  positions table (15 bytes a row), sorted once by the token at the position and by the token after it;
- positions (one per distinct (doc, pos) a trigger holds): token, next token, and the context text as one
  Arrow string array, searched by RE2 (``pyarrow.compute.match_substring_regex``: linear time, so no
  pattern can stall the server).

Neurons are numbered flat: ``layer_position * d_ff + neuron`` (the row of the neurons table).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvmem.errors import KvmemError
from kvmem.explorer.snapshot import SCORERS

__all__ = ["SearchIndex", "TokenMatch", "regex_mask", "group_max"]

SIDES = ("top", "bottom")


def regex_mask(strings: pa.ChunkedArray | pa.Array, pattern: str, *, ignore_case: bool = False) -> np.ndarray:
    """Which strings match ``pattern`` (RE2 syntax, searched anywhere in the string); a one-line error if bad."""
    if not pattern:
        raise KvmemError("an empty regular expression matches everything; type a pattern")
    try:
        mask = pc.match_substring_regex(strings, pattern=pattern, ignore_case=ignore_case)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
        reason = str(error).split(":", 1)[-1].strip() or str(error)
        raise KvmemError(f"bad regular expression {pattern!r}: {reason} (RE2 syntax: no look-around or "
                         f"back-references)") from None
    return np.asarray(mask.to_numpy(zero_copy_only=False), dtype=bool)


def group_max(keys: np.ndarray, values: np.ndarray, *, lowest: bool = False) -> tuple[np.ndarray, ...]:
    """Group ``values`` by ``keys``: (unique keys, count, the max (min) value, index of that entry in the input)."""
    if len(keys) == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, np.zeros(0, values.dtype), empty
    order = np.lexsort((values if lowest else -values, keys))  # by key, best value first
    sorted_keys = keys[order]
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    counts = np.diff(np.r_[starts, len(keys)])
    best = order[starts]
    return sorted_keys[starts], counts, values[best], best


@dataclass(frozen=True)
class TokenMatch:
    """Token ids a query names, and how it was read."""

    ids: list[int]
    note: str


class _Vocabulary:
    """Token strings seen in the indexed tables: id -> text, and text -> ids."""

    def __init__(self, size: int):
        self.text: dict[int, str] = {}
        self._seen = np.zeros(max(size, 1), bool)
        self._by_text: dict[str, list[int]] | None = None
        self._stripped: dict[str, list[int]] = {}

    def add(self, ids: np.ndarray, strings: pa.Array) -> None:
        ids = np.asarray(ids, np.int64)
        valid = (ids >= 0) & (ids < len(self._seen))
        fresh = np.flatnonzero(valid & ~self._seen[np.where(valid, ids, 0)])
        if not len(fresh):
            return
        _, first = np.unique(ids[fresh], return_index=True)
        take = fresh[first]
        for token_id, text in zip(ids[take].tolist(), strings.take(pa.array(take)).to_pylist()):
            self.text[token_id] = text
        self._seen[ids[take]] = True
        self._by_text = None

    def freeze(self) -> None:
        """Build the text -> ids maps (again after more tokens were added)."""
        by_text: dict[str, list[int]] = {}
        stripped: dict[str, list[int]] = {}
        for token_id, text in self.text.items():
            by_text.setdefault(text, []).append(token_id)
            stripped.setdefault(text.strip(), []).append(token_id)
        self._by_text, self._stripped = by_text, stripped

    def match(self, query: str) -> TokenMatch:
        """``#123``: token id 123. Text with a leading or trailing space: that exact token. Other text: every
        token equal to it once surrounding whitespace is dropped (``Paris`` finds ``Paris`` and `` Paris``)."""
        if query.startswith("#") and query[1:].isdigit():
            token_id = int(query[1:])
            return TokenMatch([token_id], f"token id {token_id} ({self.text.get(token_id, 'not seen')!r})")
        exact = query != query.strip()
        if self._by_text is None:
            self.freeze()
        ids = self._by_text.get(query, []) if exact else self._stripped.get(query.strip(), [])
        shown = ", ".join(repr(self.text[i]) for i in sorted(ids)[:8])
        how = "exactly" if exact else "ignoring surrounding spaces"
        return TokenMatch(sorted(ids), f"tokens matching {query!r} {how}: {shown or 'none in this atlas'}")


class SearchIndex:
    """Compact indexes of one atlas (:class:`kvmem.explorer.snapshot.Snapshot`), each built on first use."""

    def __init__(self, snapshot):
        self.snapshot = snapshot
        atlas = snapshot.atlas
        self.layer_position = np.full(max(snapshot.layers) + 1, -1, np.int64)
        self.layer_position[snapshot.layers] = np.arange(len(snapshot.layers))
        self.vocabulary = _Vocabulary(int(atlas.manifest.model.get("vocab_size", 0) or 0))
        self._values: dict[str, dict] = {}
        self._triggers: dict | None = None
        self._explanations: dict | None = None
        self._lock = threading.Lock()
        self.build_seconds: dict[str, float] = {}

    def flat_of(self, layer: np.ndarray, neuron: np.ndarray) -> np.ndarray:
        return (self.layer_position[np.asarray(layer, np.int64)] * self.snapshot.d_ff
                + np.asarray(neuron, np.int64)).astype(np.int32)

    @property
    def has_triggers(self) -> bool:
        """Whether the trigger index is built (pages show its columns only then, rather than build it)."""
        return self._triggers is not None

    # ---- building ----
    def build_all(self) -> None:
        """Every index (the server calls this in a background thread at start)."""
        for convention in self.snapshot.atlas.conventions:
            self.values(convention)
        self.triggers()
        self.explanations()
        self.vocabulary.freeze()

    def values(self, convention: str) -> dict:
        """{kind: (token ids sorted [R], flat [R], rank [R], score [R])} and the rank-0 promoted token of each neuron."""
        if convention not in self.snapshot.atlas.conventions:
            raise KvmemError(f"convention {convention!r} is not in this atlas; it has "
                             f"{', '.join(self.snapshot.atlas.conventions)}")
        with self._lock:
            if convention not in self._values:
                import time

                start = time.perf_counter()
                self._values[convention] = self._build_values(convention)
                self.build_seconds[f"values:{convention}"] = time.perf_counter() - start
            return self._values[convention]

    def _build_values(self, convention: str) -> dict:
        parts: dict[str, list] = {"promote": [], "suppress": []}
        columns = ["layer", "neuron", "convention", "kind", "rank", "token_id", "token", "score"]
        groups = self.snapshot.atlas.row_groups("values", columns) if self.snapshot.has("values") else ()
        for group in groups:  # an atlas without the table (lazy projections): no value index, no promoted token
            group = group.filter(pc.equal(group.column("convention"), convention))
            if not len(group):
                continue
            token = group.column("token_id").to_numpy()
            self.vocabulary.add(token, group.column("token").combine_chunks())
            flat = self.flat_of(group.column("layer").to_numpy(), group.column("neuron").to_numpy())
            kind = group.column("kind").to_numpy(zero_copy_only=False)
            for name in parts:
                keep = kind == name
                parts[name].append((token[keep].astype(np.int32), flat[keep], group.column("rank").to_numpy()[keep]
                                    .astype(np.int16), group.column("score").to_numpy()[keep].astype(np.float32)))
        out: dict = {}
        top = np.full(self.snapshot.n_neurons, -1, np.int32)
        for name, chunks in parts.items():
            token, flat, rank, score = (np.concatenate([c[i] for c in chunks]) if chunks else np.zeros(0, t)
                                        for i, t in enumerate((np.int32, np.int32, np.int16, np.float32)))
            if name == "promote":
                first = rank == 0
                top[flat[first]] = token[first]
            order = np.argsort(token, kind="stable")
            out[name] = (token[order], flat[order], rank[order], score[order])
        out["top_token"] = top
        return out

    def triggers(self) -> dict:
        """The trigger rows (top and bottom kinds) and the positions they hold (see the module docstring)."""
        with self._lock:
            if self._triggers is None:
                import time

                start = time.perf_counter()
                self._triggers = self._build_triggers()
                self.build_seconds["triggers"] = time.perf_counter() - start
            return self._triggers

    def _build_triggers(self) -> dict:
        atlas = self.snapshot.atlas
        codes, token, next_token, texts, spans = [], [], [], [], []
        for group in atlas.row_groups("contexts", ["doc", "pos", "token_id", "token", "next_token_id", "next_token",
                                                   "context", "span_start", "span_end"]):
            codes.append((group.column("doc").to_numpy().astype(np.int64) << 32)
                         | group.column("pos").to_numpy().astype(np.int64))
            token.append(group.column("token_id").to_numpy().astype(np.int32))
            next_token.append(group.column("next_token_id").to_numpy().astype(np.int32))
            self.vocabulary.add(token[-1], group.column("token").combine_chunks())
            self.vocabulary.add(next_token[-1], group.column("next_token").combine_chunks())
            texts.extend(group.column("context").chunks)
            spans.append(np.stack([group.column("span_start").to_numpy(), group.column("span_end").to_numpy()], 1)
                         .astype(np.int32))
        codes_all = np.concatenate(codes) if codes else np.zeros(0, np.int64)
        order = np.argsort(codes_all, kind="stable")
        position_token = np.concatenate(token)[order] if token else np.zeros(0, np.int32)
        position_next = np.concatenate(next_token)[order] if next_token else np.zeros(0, np.int32)
        context = pa.chunked_array(texts, pa.string()).take(pa.array(order)) if texts else pa.chunked_array([], pa.string())
        codes_all = codes_all[order]
        span = np.concatenate(spans)[order] if spans else np.zeros((0, 2), np.int32)  # [positions, 2]

        rows: dict[str, list] = {"flat": [], "side": [], "rank": [], "activation": [], "position": []}
        for group in atlas.row_groups("triggers", ["layer", "neuron", "kind", "rank", "activation", "doc", "pos"]):
            kind = group.column("kind").to_numpy(zero_copy_only=False)
            side = np.where(kind == "top", 0, np.where(kind == "bottom", 1, -1)).astype(np.int8)
            keep = side >= 0
            if not keep.any():
                continue
            code = ((group.column("doc").to_numpy().astype(np.int64) << 32)
                    | group.column("pos").to_numpy().astype(np.int64))[keep]
            at = np.searchsorted(codes_all, code)
            if len(code) and (at.max() >= len(codes_all) or not np.array_equal(codes_all[at], code)):
                raise KvmemError(f"{atlas.path}: triggers point at positions missing from the contexts table; the "
                                 f"atlas is damaged, scan again")
            rows["flat"].append(self.flat_of(group.column("layer").to_numpy()[keep], group.column("neuron").to_numpy()[keep]))
            rows["side"].append(side[keep])
            rows["rank"].append(group.column("rank").to_numpy()[keep].astype(np.int16))
            rows["activation"].append(group.column("activation").to_numpy()[keep].astype(np.float32))
            rows["position"].append(at.astype(np.int32))
        kinds = {"flat": np.int32, "side": np.int8, "rank": np.int16, "activation": np.float32, "position": np.int32}
        out = {name: np.concatenate(parts) if parts else np.zeros(0, kinds[name]) for name, parts in rows.items()}
        fires = position_token[out["position"]]
        follows = position_next[out["position"]]
        out["by_token"] = np.argsort(fires, kind="stable").astype(np.int32)
        out["token_sorted"] = fires[out["by_token"]]
        out["by_next"] = np.argsort(follows, kind="stable").astype(np.int32)
        out["next_sorted"] = follows[out["by_next"]]
        top_trigger = np.full(self.snapshot.n_neurons, -1, np.int32)
        first = (out["side"] == 0) & (out["rank"] == 0)
        top_trigger[out["flat"][first]] = fires[first]
        out.update(position_token=position_token, position_next=position_next, context=context, span=span,
                   top_trigger_token=top_trigger)
        return out

    def explanations(self) -> dict:
        """The explanations as arrays (flat neuron, text, each scorer's score), built once per index."""
        with self._lock:
            if self._explanations is not None:
                return self._explanations
            frame = self.snapshot.explanations
            cached = {"flat": self.flat_of(frame.layer.to_numpy(), frame.neuron.to_numpy()) if len(frame) else
                      np.zeros(0, np.int32),
                      "text": pa.array(frame.text.tolist() if len(frame) else [], pa.string())}
            for scorer in SCORERS:
                column = frame[scorer].to_numpy(dtype=float) if scorer in frame and len(frame) else np.full(len(frame), np.nan)
                cached[scorer] = column
            best = {}
            for scorer in SCORERS:
                values = np.where(np.isfinite(cached[scorer]), cached[scorer], -np.inf)
                keys, _, top, _ = group_max(cached["flat"].astype(np.int64), values)
                full = np.full(self.snapshot.n_neurons, np.nan)
                full[keys] = np.where(np.isfinite(top), top, np.nan)
                best[scorer] = full
            cached["best"] = best
            first = {}
            for row, flat in enumerate(cached["flat"].tolist()):
                first.setdefault(flat, row)
            cached["first"] = first
            self._explanations = cached
            return cached

    # ---- queries: each returns (flat [H], count [H], best [H], example trigger row or -1 [H]) ----
    def value_hits(self, ids: list[int], convention: str, kind: str) -> tuple[np.ndarray, ...]:
        """Neurons whose value lists one of ``ids`` among its ``kind`` (promote | suppress) tokens: the best
        score (most negative for suppress), and its rank as the example."""
        token, flat, rank, score = self.values(convention)[kind]
        picked = _slices(token, ids)
        keys, counts, best, at = group_max(flat[picked], score[picked], lowest=kind == "suppress")
        return keys, counts, best, rank[picked][at].astype(np.int64)

    def trigger_hits(self, ids: list[int], side: str, *, following: bool = False) -> tuple[np.ndarray, ...]:
        """Neurons with kept ``side`` triggers on one of ``ids`` (``following``: right before one of them)."""
        t = self.triggers()
        order, keys = (t["by_next"], t["next_sorted"]) if following else (t["by_token"], t["token_sorted"])
        rows = order[_slices(keys, ids)]
        rows = rows[t["side"][rows] == SIDES.index(side)]
        return self._grouped(rows, side)

    def context_hits(self, pattern: str, side: str, *, ignore_case: bool = False) -> tuple[np.ndarray, ...]:
        """Neurons with kept ``side`` triggers whose context matches ``pattern`` (RE2)."""
        t = self.triggers()
        matched = regex_mask(t["context"], pattern, ignore_case=ignore_case)
        rows = np.flatnonzero(matched[t["position"]] & (t["side"] == SIDES.index(side)))
        return self._grouped(rows, side)

    def _grouped(self, rows: np.ndarray, side: str) -> tuple[np.ndarray, ...]:
        t = self.triggers()
        keys, counts, best, at = group_max(t["flat"][rows], t["activation"][rows], lowest=side == "bottom")
        return keys, counts, best, rows[at] if len(rows) else np.zeros(0, np.int64)

    def trigger_example(self, row: int) -> dict:
        """One indexed trigger row: its rank, coefficient, token and context text."""
        t = self.triggers()
        position = int(t["position"][row])
        return {"rank": int(t["rank"][row]), "activation": float(t["activation"][row]),
                "token": self.vocabulary.text.get(int(t["position_token"][position]), ""),
                "context": t["context"][position].as_py(), "span_start": int(t["span"][position, 0]),
                "span_end": int(t["span"][position, 1])}


def _slices(sorted_keys: np.ndarray, ids: list[int]) -> np.ndarray:
    """Indices of ``sorted_keys`` equal to any of ``ids``."""
    parts = []
    for token_id in ids:
        lo, hi = np.searchsorted(sorted_keys, token_id), np.searchsorted(sorted_keys, token_id, side="right")
        parts.append(np.arange(lo, hi))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)
