"""Scan settings: one frozen, keyword-only dataclass, validated with errors that name the fix."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from kvmem.conventions import CONVENTIONS
from kvmem.errors import KvmemError
from kvmem.plan import DEFAULT_BLOCK_DOCUMENTS, parse_batch_size
from kvmem.scanning.statistics import OPTIONAL

__all__ = ["ScanConfig", "parse_shard", "BLOCK_DOCUMENTS_BY_UNIT", "PROJECTIONS"]

# when the value and key projection tables are computed
PROJECTIONS = {
    "lazy": "not during the scan: Atlas.values / Atlas.keys compute a neuron's rows from the model on demand, and "
            "kvmem project (Atlas.project) writes the whole tables",
    "eager": "during the scan: the atlas holds values.parquet and keys.parquet (from the per-model cache)",
}

# short units need big blocks: a batch never spans a block, and sorting by length works within one
BLOCK_DOCUMENTS_BY_UNIT = {"document": DEFAULT_BLOCK_DOCUMENTS, "paragraph": 2048, "line": 2048, "sentence": 2048}


@dataclass(frozen=True, kw_only=True)
class ScanConfig:
    """Every setting that changes what a scan finds (all recorded in the manifest).

    layers:           layers to scan, None = all
    top_k:            triggers kept per neuron, highest and lowest
    per_document:     also keep the best position of each document (Geva et al. kept one per sentence)
    max_tokens:       stop after this many tokens read (None = whole corpus)
    window:           tokens per window (None = min(model context, 256))
    batch_size:       windows per forward pass (an int); or a token budget, ``"N tokens"`` (as many whole
                      windows as fit N padded positions); or ``"auto"``: on a GPU the largest batch whose
                      step fits in 70% of the free memory (measured by two probe batches), on a CPU
                      2,048 tokens (more gains nothing there). The plan records the resolved number.
    prepend_bos:      prepend the tokenizer's BOS token to every window (never scored)
    skip_first:       tokens at the start of every window read but not scored (default 1: the first token
                      after BOS, computed with no left context, is where position artefacts such as massive
                      activations sit, Sun et al. 2024; they would lead every ranking); 0 scores every token
    context_before / context_after: context tokens kept around each trigger
    context_activations: keep each trigger's neuron on its context tokens, read from the batch in memory as it
                      streams by (no second forward; costs memory for context_width floats per kept entry)
    top_n:            tokens kept per value / key projection, each direction
    conventions:      value projection conventions (see kvmem.conventions.CONVENTIONS)
    key_projections:  also project key (and gate) vectors through the input embedding
    projections:      when the value and key projection tables are computed (see PROJECTIONS): ``"lazy"``
                      (default: a neuron's rows on demand from the model, the whole tables by kvmem project)
                      or ``"eager"`` (written by the scan, as a model's first scan then computes them all)
    shard:            (i, n): scan the blocks of documents b with b % n == i (see kvmem.plan)
    block_documents:  documents per block, the unit that shards and ranks share out (None: 64, or 2048 when
                      the corpus unit is a paragraph, line or sentence, so that sorting by length has
                      enough documents to group)
    sort_by_length:   read each block's windows longest first, a document's shorter last window among
                      windows of its length (far less padding; with per_document, documents shortest
                      first, which keeps each document's windows together)
    random_samples:   positions in each layer's uniform random sample (0 = none), see kvmem.scanning.state;
                      the explanation scorers' non-activating examples (100: about 45 held-out quiet ones per side)
    bin_samples:      positions kept per neuron and histogram bin, for quantile samples (0 = none)
    sample_rate:      fraction of positions the bin samples draw from (bounds their per-token cost)
    seed:             seed of the samples' position keys
    checkpoint_every: tokens between checkpoints (None = no checkpoints); taken at block ends
    taxonomy_sums:    keep the neuron taxonomy's streaming sums (docs/taxonomy.md): Σ m·position, the gate/up
                      sign-quadrant counts and each trigger's gate and up pre-activations (gated FFNs), and
                      the corpus's unigram counts
    statistics:       optional statistics to keep besides those the settings above imply, by name
                      (kvmem.scanning.statistics.OPTIONAL, e.g. "magnitude_percentiles")
    """

    layers: tuple[int, ...] | None = None
    top_k: int = 25
    per_document: bool = False
    max_tokens: int | None = None
    window: int | None = None
    batch_size: int | str = 8
    prepend_bos: bool = True
    skip_first: int = 1
    context_before: int = 12
    context_after: int = 4
    context_activations: bool = True
    top_n: int = 20
    conventions: tuple[str, ...] = ("raw", "final_norm")
    key_projections: bool = True
    projections: str = "lazy"
    shard: tuple[int, int] = (0, 1)
    block_documents: int | None = None
    sort_by_length: bool = True
    random_samples: int = 100
    bin_samples: int = 4
    sample_rate: float = 0.125
    seed: int = 0
    checkpoint_every: int | None = None
    taxonomy_sums: bool = True
    statistics: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        def positive(name: str, value, allow_none: bool = False) -> None:
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise KvmemError(f"{name} must be an integer >= 1, got {value!r}")

        positive("top_k", self.top_k)
        object.__setattr__(self, "batch_size", parse_batch_size(self.batch_size))
        positive("top_n", self.top_n)
        positive("max_tokens", self.max_tokens, allow_none=True)
        positive("window", self.window, allow_none=True)
        positive("checkpoint_every", self.checkpoint_every, allow_none=True)
        positive("block_documents", self.block_documents, allow_none=True)
        for name in ("random_samples", "bin_samples", "seed", "skip_first"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise KvmemError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.sample_rate, (int, float)) or not 0 < self.sample_rate <= 1:
            raise KvmemError(f"sample_rate must be a number in (0, 1], got {self.sample_rate!r}")
        for name in ("context_before", "context_after"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise KvmemError(f"{name} must be an integer >= 0, got {value!r}")
        unknown = [c for c in self.conventions if c not in CONVENTIONS]
        if unknown or not self.conventions:
            raise KvmemError(f"unknown projection convention(s) {unknown or '(none given)'}; choose from {', '.join(CONVENTIONS)}")
        index, count = self.shard
        if not (isinstance(index, int) and isinstance(count, int) and count >= 1 and 0 <= index < count):
            raise KvmemError(f"shard must be i/N with 0 <= i < N, got {index}/{count}")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(sorted(set(int(layer) for layer in self.layers))))
            if not self.layers:
                raise KvmemError("layers is empty; pass None to scan every layer")
        object.__setattr__(self, "conventions", tuple(self.conventions))
        if self.projections not in PROJECTIONS:
            raise KvmemError(f"projections must be one of {', '.join(PROJECTIONS)}, got {self.projections!r}")
        if isinstance(self.statistics, str):
            object.__setattr__(self, "statistics", (self.statistics,))
        unknown = [name for name in self.statistics if name not in OPTIONAL]
        if unknown:
            raise KvmemError(f"unknown optional statistic(s) {unknown}; choose from {', '.join(OPTIONAL) or '(none)'}")
        object.__setattr__(self, "statistics", tuple(dict.fromkeys(self.statistics)))

    def to_dict(self) -> dict:
        data = asdict(self)
        data["layers"] = list(self.layers) if self.layers is not None else None
        data["conventions"] = list(self.conventions)
        data["shard"] = list(self.shard)
        data["statistics"] = list(self.statistics)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> ScanConfig:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values.setdefault("skip_first", 0)  # recorded since kvmem skipped first tokens; absent: every token scored
        values.setdefault("projections", "eager")  # recorded since projections became lazy; absent: written
        for name in ("layers", "conventions", "shard", "statistics"):
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        return cls(**values)

    def block_documents_for(self, unit: str) -> int:
        """Documents per block for a corpus split into ``unit``s (the setting, or its default)."""
        if self.block_documents is not None:
            return self.block_documents
        return BLOCK_DOCUMENTS_BY_UNIT.get(unit, DEFAULT_BLOCK_DOCUMENTS)

    @property
    def context_width(self) -> int:
        """Context tokens kept around a trigger, the trigger included."""
        return self.context_before + 1 + self.context_after

    # settings that must agree between a checkpoint and its resumption (all but the bookkeeping ones)
    def resume_key(self) -> dict:
        data = self.to_dict()
        data.pop("checkpoint_every")
        data.pop("projections")  # what the atlas holds, not what the stream keeps
        return data


def parse_shard(text: str) -> tuple[int, int]:
    """'2/8' -> (2, 8)."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise KvmemError(f"--shard expects i/N (e.g. 0/4), got {text!r}") from None
    return index, count
