"""The atlas format: files, tables and their columns. Change FORMAT_VERSION when this changes.

An atlas is a directory:

    manifest.json      provenance and every setting (see ``kvmem.scanning.writer.build_manifest``)
    neurons.parquet    one row per (layer, neuron)
    triggers.parquet   top / bottom coefficients: (doc, pos) and the context coefficients
    contexts.parquet   one row per distinct (doc, pos) that a trigger or sample holds: its text, once
    values.parquet     value vectors projected through the unembedding
    keys.parquet       key vectors projected through the input embedding
    histograms.parquet per-neuron coefficient histograms over fixed bins (edges in the manifest)
    samples.parquet    random and per-bin samples: (doc, pos) and coefficients
    unigrams.parquet   the corpus's exact unigram counts over the scored positions (format 4)

Texts are stored once per position: a trigger or sample row references its context by (doc, pos),
and :mod:`kvmem.atlas` joins the two, so ``atlas.triggers(...)`` returns the columns of
:data:`TRIGGER_VIEW` (the triggers table with its context's columns, in that order).

Every table is sorted by (layer, neuron, ...) and written in row groups that never span a
layer and hold at most ``ROW_GROUP_NEURONS`` neurons, so a selection reads one row group.
"""

from __future__ import annotations

__all__ = ["FORMAT_VERSION", "READABLE_VERSIONS", "TABLES", "COLUMNS", "ROW_GROUP_NEURONS", "TRIGGER_KINDS",
           "SAMPLE_KINDS", "KEY_VECTORS", "KEY_VECTOR_NAMES", "KEY_VECTOR_ROWS", "CONTEXT_KEY", "CONTEXT_TEXT", "TRIGGER_VIEW", "SAMPLE_VIEW", "arrow_schema",
           "conform"]

# 2: manifest records the batching plan (block_documents, batch_size, max_tokens) and timing per
#    phase; a shard atlas keeps its mergeable state in state/. Tables are unchanged from 1.
# 3: texts once per position: triggers and samples reference the ``contexts`` table by (doc, pos)
#    (format 2 kept the text in every trigger row and a ``sample_contexts`` table for the samples).
# 4: the neuron taxonomy's streaming sums: neurons gain position_act_sum, position_sum, position_sq_sum and
#    the gate/up sign-quadrant counts; triggers gain gate_pre and up_pre; a unigrams table.
FORMAT_VERSION = 4
READABLE_VERSIONS = (4,)  # earlier formats were never released: rescan
ROW_GROUP_NEURONS = 256  # a neuron's triggers read in 3 ms; 64 cost 40% more writing time for 1.7 ms
TABLES = ("neurons", "triggers", "contexts", "values", "keys", "histograms", "samples", "unigrams")
SAMPLE_KINDS = ("random", "bin")

TRIGGER_KINDS = ("top", "bottom", "top_doc", "bottom_doc")  # *_doc: one trigger per document
KEY_VECTORS = ("key", "gate")  # key: W1 / W_up row; gate: W_gate row (gated FFNs only)
# how pages, reports and the CLI name each vector, and the weight row it is
KEY_VECTOR_NAMES = {"key": "key k", "gate": "gate key g"}
KEY_VECTOR_ROWS = {"key": "a row of W1 / W_up", "gate": "a row of W_gate"}

# table -> column -> meaning (the order is the column order on disk)
COLUMNS: dict[str, dict[str, str]] = {
    "neurons": {
        "layer": "int16, FFN layer",
        "neuron": "int32, neuron i within the layer (row of W1 / column of W2)",
        "count": "int64, positions scanned",
        "mean": "float64, mean coefficient m_i",
        "std": "float64, population standard deviation of m_i",
        "min": "float32, lowest m_i seen",
        "max": "float32, highest m_i seen",
        "frac_positive": "float64, fraction of positions with m_i > 0",
        "act_sum": "float64, sum of m_i (for exact merging)",
        "act_sq_sum": "float64, sum of m_i^2 (for exact merging)",
        "key_norm": "float32, ||k_i|| (W1 row, W_up row when gated)",
        "gate_norm": "float32, ||g_i|| (W_gate row), NaN for a plain FFN",
        "value_norm": "float32, ||w_i||: the norm of what neuron i writes into the residual (Model.written_values; ||v_i|| but on post-norm or scaled FFNs)",
        "position_act_sum": "float64, sum of m_i * p, p the position in the window (0 = its first token, which a default scan reads but does not score); null when the scan kept no taxonomy sums",
        "position_sum": "int64, sum of p over the positions (the same for every neuron); null likewise",
        "position_sq_sum": "int64, sum of p^2 (the same for every neuron); null likewise",
        "quadrant_pp": "int64, positions with gate pre-activation > 0 and up pre-activation > 0 (gated FFNs; null otherwise)",
        "quadrant_pn": "int64, positions with gate > 0 and up <= 0",
        "quadrant_np": "int64, positions with gate <= 0 and up > 0",
        "quadrant_nn": "int64, positions with gate <= 0 and up <= 0",
    },
    "triggers": {
        "layer": "int16",
        "neuron": "int32",
        "kind": "string: top | bottom | top_doc | bottom_doc",
        "rank": "int16, 0 = most extreme",
        "activation": "float32, the coefficient m_i at this position",
        "doc": "int64, index of the document in the corpus stream (with pos: the row of contexts)",
        "pos": "int32, token position within the document's token sequence",
        "context_activations": "list<float32>, m_i of this neuron at each context token (empty if not computed)",
        "gate_pre": "float32, the gate pre-activation W_gate x at this position (gated FFNs with taxonomy sums; NaN otherwise)",
        "up_pre": "float32, the up pre-activation W_up x at this position (likewise)",
    },
    "contexts": {
        "doc": "int64, index of the document in the corpus stream",
        "pos": "int32, token position within the document",
        "doc_id": "string, the document's stable id",
        "token_id": "int32, the token at this position",
        "token": "string, its text",
        "next_token_id": "int32, the following token in the document, -1 at the end",
        "next_token": "string, its text ('' at the end)",
        "context": "string, text of the context tokens (inside the window the model read)",
        "span_start": "int32, character offset of the position's token in context",
        "span_end": "int32, end offset (exclusive)",
        "context_tokens": "list<string>, the context split into tokens (concatenated they give context)",
        "context_trigger": "int16, index of the position's token in context_tokens",
    },
    "values": {
        "layer": "int16",
        "neuron": "int32",
        "convention": "string: a projection convention (kvmem.conventions.CONVENTIONS)",
        "kind": "string: promote | suppress",
        "rank": "int16, 0 = strongest",
        "token_id": "int32",
        "token": "string",
        "score": "float32, the token's logit contribution per unit coefficient",
    },
    "keys": {
        "layer": "int16",
        "neuron": "int32",
        "vector": "string: key | gate",
        "kind": "string: promote | suppress (highest / lowest dot product with the input embedding)",
        "rank": "int16",
        "token_id": "int32",
        "token": "string",
        "score": "float32, W_E[token] . k",
    },
    "samples": {
        "layer": "int16",
        "neuron": "int32",
        "kind": "string: random (the layer's uniform random sample of positions) | bin (a histogram bin's sample)",
        "bin": "int16, histogram bin of a bin sample (edges in manifest['histogram']['edges']), -1 for random",
        "rank": "int16, order by the position's sampling key (0 first)",
        "activation": "float32, the coefficient m_i at this position",
        "doc": "int64, index of the document in the corpus stream",
        "pos": "int32, token position within the document",
        "context_activations": "list<float32>, m_i at each context token (random samples; empty for bin samples)",
    },
    "histograms": {
        "layer": "int16",
        "neuron": "int32",
        "counts": "list<int64> of length HIST_BINS, counts per bin (edges in manifest['histogram']['edges'])",
    },
    "unigrams": {
        "token_id": "int32, every id of the model's vocabulary, ascending",
        "count": "int64, scored positions holding this token (BOS and padding are never scored); empty table when the scan kept no taxonomy sums",
    },
}


CONTEXT_KEY = ("doc", "pos")  # how triggers and samples reference a row of contexts
CONTEXT_TEXT = tuple(name for name in COLUMNS["contexts"] if name not in CONTEXT_KEY)
# the frames atlas.triggers / atlas.samples return: the table's columns with its context's, in this order
TRIGGER_VIEW = ("layer", "neuron", "kind", "rank", "activation", "doc", "doc_id", "pos", "token_id", "token",
                "next_token_id", "next_token", "context", "span_start", "span_end", "context_tokens",
                "context_trigger", "context_activations", "gate_pre", "up_pre")
SAMPLE_VIEW = (*COLUMNS["samples"], *CONTEXT_TEXT)


def _arrow_type(description: str):
    """The Arrow type a column description starts with (``int16``, ``list<string>``, ...)."""
    import pyarrow as pa

    from kvmem.scanning.bins import HIST_BINS

    head = description.split(",")[0].split(":")[0].split(" ")[0].strip()
    scalars = {"int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(), "float32": pa.float32(),
               "float64": pa.float64(), "string": pa.string()}
    if head in scalars:
        return scalars[head]
    if head == "list<int64>":  # the histogram counts, fixed length
        return pa.list_(pa.int64(), HIST_BINS)
    if head.startswith("list<") and head.endswith(">"):
        return pa.large_list(scalars[head[5:-1]])
    raise ValueError(f"no Arrow type for column description {description!r}")


def arrow_schema(table: str, columns: dict[str, str] | None = None):
    """The Arrow schema of an atlas table, built from :data:`COLUMNS` (the one definition), or from ``columns``
    (column -> description) for a table a statistic defines (``Statistic.table_columns``)."""
    import pyarrow as pa

    return pa.schema([(name, _arrow_type(text)) for name, text in (columns or COLUMNS[table]).items()])


def conform(table, name: str, columns: dict[str, str] | None = None):
    """``table`` cast to the schema of atlas table ``name`` (or of ``columns``, see :func:`arrow_schema`); a
    missing, extra or mistyped column raises."""
    schema = arrow_schema(name, columns)
    if table.column_names != schema.names:
        missing = [c for c in schema.names if c not in table.column_names]
        extra = [c for c in table.column_names if c not in schema.names]
        raise ValueError(f"table {name!r} drifted from kvmem.schema.COLUMNS: missing {missing}, extra {extra}"
                         f"{'' if missing or extra else ', columns out of order'}")
    for field, expected in zip(table.schema, schema):
        if field.type != expected.type:
            raise ValueError(f"table {name!r}: column {field.name!r} is {field.type}, kvmem.schema says {expected.type}")
    return table.cast(schema)
