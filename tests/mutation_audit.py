"""Mutation audit: change one thing at a time in a copy of the code, run the test file that owns it,
and report whether a test failed (it should). Not collected by pytest; run it by hand:

    python tests/mutation_audit.py [NAME ...]

Each mutation names a file, one exact piece of text in it and its replacement, and the test file(s)
to run. The copy is a temporary directory holding kvmem/, tests/, data/ and pyproject.toml; the
working tree is never touched. A mutation whose text is no longer found is reported as stale.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    select: str | None = None  # pytest -k expression, to run only the tests that own the code


MUTATIONS = [
    Mutation("layer-vs-memories reads the lens before the FFN from the rows after it", "kvmem/experiments/layer_prediction.py",
             "before = lens_of[i * n:(i + 1) * n]", "before = lens_of[(len(chosen) + i) * n:(len(chosen) + i + 1) * n]",
             ("tests/test_experiments_forward.py",), "equals_plain_hf_hooks"),
    Mutation("next-token rank counts a block from the product's first rows", "kvmem/experiments/ranks.py",
             "scores = product[start - first:start - first + block]", "scores = product[start:start + block]",
             ("tests/test_experiments.py",), "pair_ranks"),
    Mutation("taxonomy moments take a lone last row on its own", "kvmem/taxonomy/weights.py",
             "if len(groups) > 1 and groups[-1][1] - groups[-1][0] == 1:", "if False:",
             ("tests/test_taxonomy.py",), "do_not_depend"),
    Mutation("projection screen rescores only the first n candidates", "kvmem/scanning/projection_screen.py",
             "m = max(n, int(inside.sum(dim=1).max()))", "m = n", ("tests/test_projection_screen.py",), None),
    Mutation("a lazy atlas's one-convention values read every convention", "kvmem/atlas_projections.py",
             "model, labels=(convention,))", "model, labels=None)", ("tests/test_taxonomy.py",), "lazy"),
    Mutation("projection rescoring sums d_model in another order", "kvmem/scanning/projection_screen.py",
             "total = part.double().mul_(a64[:, None, :]).cumsum(2)[:, :, -1]",
             "total = part.double().mul_(a64[:, None, :]).sum(2)", ("tests/test_projection_screen.py",), None),
    Mutation("next-token rank counts a threshold equal to the score as below it", "kvmem/experiments/ranks.py",
             "left_s += (active & (value < s)).long()", "left_s += (active & (value <= s)).long()",
             ("tests/test_experiments.py",), "pair_ranks"),
    Mutation("next-token rank counts the scores of a bin with thresholds twice", "kvmem/experiments/ranks.py",
             "quiet = torch.where(in_bin == 0, per_bin, 0)", "quiet = per_bin", ("tests/test_experiments.py",),
             "pair_ranks"),
    Mutation("sign test's binomial tail one term short", "kvmem/experiments/stats.py",
             "for k in range(min(positive, n - positive)):", "for k in range(max(min(positive, n - positive) - 1, 0)):",
             ("tests/test_experiments_stats.py",), "sign_test"),
    Mutation("atlas layer tables built for the first table only", "kvmem/scanning/writer.py",
             "for stream, table, statistic in streams:\n                        stream.put(",
             "for stream, table, statistic in streams[:1]:\n                        stream.put(",
             ("tests/test_scan.py",), None),
    Mutation("token removal reads the first-removed prefix one token early", "kvmem/experiments/removal.py",
             'shifted.setdefault(at - 1, []).append((i, "first"))', 'shifted.setdefault(at - 2, []).append((i, "first"))',
             ("tests/test_experiments.py",), "token_removal"),
    Mutation("value top tokens read from kept rows of rank 1", "kvmem/experiments/atlas_inputs.py",
             'rows = rows.filter(pc.equal(rows.column("rank"), 0))', 'rows = rows.filter(pc.equal(rows.column("rank"), 1))',
             ("tests/test_experiments.py",), "value_top_tokens"),
    Mutation("context keeps one token fewer before (text)", "kvmem/scanning/texts.py",
             "c0, c1 = np.maximum(at - before, min(lead, n)), ", "c0, c1 = np.maximum(at - before + 1, min(lead, n)), ",
             ("tests/test_context_limits.py",)),
    Mutation("context keeps one token fewer before (coefficients)", "kvmem/scanning/step.py",
             "steps = torch.arange(-context_before, ", "steps = torch.arange(-context_before + 1, ",
             ("tests/test_context_limits.py",)),
    Mutation("context_after 4 -> 3", "kvmem/scanning/config.py",
             "context_after: int = 4", "context_after: int = 3", ("tests/test_context_limits.py",)),
    Mutation("quantile bands by the count after each bin", "kvmem/atlas.py",
             "band_of_bin = np.searchsorted(np.asarray(levels[1:-1]), before, side=\"right\")",
             "band_of_bin = np.searchsorted(np.asarray(levels[1:-1]), cumulative, side=\"right\")",
             ("tests/test_export.py",), "quantile"),
    Mutation("equal quantile bands by the count after each bin", "kvmem/atlas.py",
             "band_of_bin = np.minimum((before * bands).astype(int), bands - 1)",
             "band_of_bin = np.minimum((cumulative * bands).astype(int), bands - 1)",
             ("tests/test_export.py",), "quantile"),
    Mutation("quantile_boundaries use the upper edge of the bin", "kvmem/export/neuron_explainer.py",
             "edge = float(histogram.low.iloc[bins[0]])", "edge = float(histogram.high.iloc[bins[0]])",
             ("tests/test_export.py",), "quantile or round_trip"),
    Mutation("bootstrap_ci ignores its weights", "kvmem/experiments/stats.py",
             "weights = np.ones(len(values)) if weights is None else np.asarray(weights, np.float64)",
             "weights = np.ones(len(values))", ("tests/test_experiments_stats.py",), "bootstrap"),
    Mutation("merge drops the second state's random sample", "kvmem/scanning/statistics/samples.py",
             "SamplesState(a.random.merge(b.random) if", "SamplesState(a.random if", ("tests/test_state_merge.py",)),
    Mutation("random sample merge drops one entry", "kvmem/scanning/statistics/samples.py",
             "order = order_by_key(keys_or_none(codes, self.seed), codes, 0)[:size]",
             "order = order_by_key(keys_or_none(codes, self.seed), codes, 0)[:size]\n"
             "        order = torch.cat([order[1:], order[:1].new_full((1,), codes.shape[0] - 1)])",
             ("tests/test_state_merge.py",)),
    Mutation("histograms merged with max", "kvmem/scanning/statistics/histograms.py",
             "HistogramState(a.counts + b.counts,", "HistogramState(torch.maximum(a.counts, b.counts),",
             ("tests/test_state_merge.py",)),
    Mutation("pack wraps around past 2^32 positions", "kvmem/plan.py",
             "    _check_packable(doc, pos)\n", "", ("tests/test_inputs.py",), "pack"),
    Mutation("fused gate/up halves swapped in the scan's reading", "kvmem/models.py",
             '"pre": (f"{ffn}.{spec.gate or spec.key}", "output", 0 if spec.fused_gate_up else None)',
             '"pre": (f"{ffn}.{spec.gate or spec.key}", "output", 1 if spec.fused_gate_up else None)',
             ("tests/test_capture_ffn.py",), "phi3"),
    Mutation("the scan's view keeps the bridge's eager attention", "kvmem/unbridged.py",
             "if isinstance(copied, PretrainedConfig) and attention is not None:",
             "if isinstance(copied, PretrainedConfig) and attention is None:",
             ("tests/test_capture_ffn.py",), "shares"),
    Mutation("the window context reads the row before the window", "kvmem/scanning/step.py",
             "inside = (around >= first.index_select(0, rows)[:, None])",
             "inside = (around >= first.index_select(0, rows)[:, None] - 1)",
             ("tests/test_accumulator.py",), "window_context or window_rows"),
    Mutation("the dense first cut keeps one fewer than k per neuron", "kvmem/scanning/statistics/sides.py",
             "kth = torch.topk(acts, k, dim=0,", "kth = torch.topk(acts, max(k - 1, 1), dim=0,",
             ("tests/test_accumulator.py",), "dense_first_batch"),
    Mutation("the extras read the row before", "kvmem/scanning/step.py",
             "    at = rows * d_ff + neurons\n", "    at = (rows - 1).clamp(min=0) * d_ff + neurons\n",
             ("tests/test_accumulator.py",), "window_context or window_rows"),
    Mutation("an |m| percentile one rank too high", "kvmem/scanning/statistics/magnitude_percentiles.py",
             "np.asarray(levels, np.float64)[None, :] - 1)", "np.asarray(levels, np.float64)[None, :])",
             ("tests/test_magnitude_percentiles.py",), "percentile_lies"),
    Mutation("|m| counts merged with max", "kvmem/scanning/statistics/magnitude_percentiles.py",
             "    def merge(self, a: Tensor, b: Tensor) -> Tensor:\n        return a + b",
             "    def merge(self, a: Tensor, b: Tensor) -> Tensor:\n        return torch.maximum(a, b)",
             ("tests/test_magnitude_percentiles.py",), "merged_shards"),
    Mutation("rows computed on demand name the wrong neurons", "kvmem/scanning/projection.py",
             "np.arange(len(ids), dtype=np.int32) if neurons is None else neurons.numpy().astype(np.int32)",
             "np.arange(len(ids), dtype=np.int32)",
             ("tests/test_projections_on_demand.py",), "bit_for_bit"),
    Mutation("the output scorer's opposed tokens count as written", "kvmem/autointerp/array_scores.py",
             "held = [(t, True) for t in written] + [(t, False) for t in opposed]",
             "held = [(t, True) for t in written] + [(t, True) for t in opposed]",
             ("tests/test_explain_vectorised.py",), "per_side"),
    Mutation("the sides' shift intervals forget chance", "kvmem/autointerp/scorers/nulls.py",
             "low, high = at - (high_q - centre), at - (low_q - centre)",
             "low, high = at - high_q, at - low_q", ("tests/test_explain_vectorised.py",), "per_side"),
    Mutation("batched record permutations move predictions, not activations", "kvmem/autointerp/scorers/nulls.py",
             "cross = dots[:, perms, np.arange(g)[None, :]].sum(axis=2)",
             "cross = dots[:, np.arange(g)[None, :], perms].sum(axis=2)",
             ("tests/test_explain_nulls.py",), "record_permutations"),
    Mutation("a quantile's block is summed from its own end", "kvmem/experiments/stats.py",
             "before = np.where(in_block > 0, ends[rows, np.maximum(in_block - 1, 0)], 0.0)",
             "before = np.where(in_block > 0, ends[rows, in_block], 0.0)",
             ("tests/test_experiments_stats.py",), "grouped_quantile"),
    Mutation("a block's shorter last windows keep corpus order", "kvmem/plan.py",
             "    yield from sorted(tails, key=lambda tail: -len(tail.tokens))", "    yield from tails",
             ("tests/test_corpus.py",), "longest_windows_first"),
    Mutation("a per-document scan reads windows longest first", "kvmem/scanning/runner.py",
             "longest_windows_first=config.sort_by_length and not config.per_document,",
             "longest_windows_first=config.sort_by_length,",
             ("tests/test_corpus.py",), "longest_windows_first"),
    Mutation("an atlas's longest-first plan is read back as documents first", "kvmem/plan.py",
             'longest_windows_first=bool(data.get("longest_windows_first", False)),',
             "longest_windows_first=False,",
             ("tests/test_corpus.py",), "longest_windows_first"),
    Mutation("an earlier kvmem's checkpoint read the same way is refused", "kvmem/scanning/checkpoint.py",
             '                differ.remove("plan")', "                pass",
             ("tests/test_scan_resume.py",), "resume_after_sigkill"),
    Mutation("an earlier kvmem's checkpoint in the other order gets the generic message", "kvmem/scanning/checkpoint.py",
             ("            elif \"longest_windows_first\" not in saved[\"plan\"] and before == replace(now, "
              "longest_windows_first=False):"), "            elif False:",
             ("tests/test_scan_resume.py",), "resume_after_sigkill"),
    Mutation("a command line imports every command's module", "kvmem/cli/__init__.py",
             "        if argv is not None and name != chosen:", "        if False:",
             ("tests/test_cli_options.py",), "imports_only"),
    Mutation("the block-by-block search skips each block's last row", "kvmem/scanning/statistics/sides.py",
             "rows = block[:, None] * BLOCK_ROWS + torch.arange(BLOCK_ROWS, device=acts.device)",
             "rows = block[:, None] * BLOCK_ROWS + torch.arange(BLOCK_ROWS - 1, device=acts.device)",
             ("tests/test_accumulator.py",), "any_code_order"),
    Mutation("the writer leaves torch on one thread", "kvmem/scanning/writer.py",
             "    finally:\n        torch.set_num_threads(before)", "    finally:\n        pass",
             ("tests/test_writer.py",), "torch_thread"),
    Mutation("a neuron's rows are looked for past its row group's first neuron", "kvmem/atlas_tables.py",
             "if lay == layer and (neuron is None or lo <= neuron <= hi)]",
             "if lay == layer and (neuron is None or lo < neuron <= hi)]",
             ("tests/test_scan.py",)),
    Mutation("rows handed to the store twice keep their first copy", "kvmem/autointerp/store.py",
             'rows = rows[~rows.duplicated(list(KEY), keep="last")]', 'rows = rows[~rows.duplicated(list(KEY), keep="first")]',
             ("tests/test_explain_atlas.py", "tests/test_explain_vectorised.py", "tests/test_explain_sides.py",
              "tests/test_explain.py")),
    Mutation("the GGUF key rows keep llama.cpp's rotary order under grouped heads", "kvmem/gguf_conversion.py",
             "weights = _rotary_rows(weights, kv_heads)", "weights = _rotary_rows(weights, heads)",
             ("tests/test_gguf_conversion.py",), "builtin_conversion"),
    Mutation("a GGUF file whose output weights are its own is read as tied", "kvmem/gguf_conversion.py",
             '{"tie_word_embeddings": "output.weight" not in gguf.tensors}', '{"tie_word_embeddings": True}',
             ("tests/test_gguf_conversion.py",), "one_line_errors"),
]


def copy_tree(target: Path) -> None:
    for name in ("kvmem", "tests", "data", "notebooks", "docs"):
        if (ROOT / name).exists():
            shutil.copytree(ROOT / name, target / name)
    for name in ("pyproject.toml", "README.md"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, target / name)


def run(mutation: Mutation) -> tuple[str, float, str]:
    with tempfile.TemporaryDirectory(prefix="kvmem-mutation-") as tmp:
        copy = Path(tmp)
        copy_tree(copy)
        path = copy / mutation.path
        text = path.read_text()
        if text.count(mutation.old) != 1:
            return "stale (text not found once)", 0.0, ""
        path.write_text(text.replace(mutation.old, mutation.new))
        # one process (-n 0): under xdist, -x stops the workers and pytest exits 2 instead of 1
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider", *mutation.tests]
        if mutation.select:
            command += ["-k", mutation.select]
        env = {**os.environ, "PYTHONPATH": str(copy)}
        started = time.perf_counter()
        result = subprocess.run(command, cwd=copy, capture_output=True, text=True, env=env)
        seconds = time.perf_counter() - started
        last = (result.stdout.strip().splitlines() or [""])[-1]
        verdict = "caught (a test failed)" if result.returncode == 1 else \
            "MISSED (tests passed)" if result.returncode == 0 else f"error (pytest exit {result.returncode})"
        return verdict, seconds, last


def main(names: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not names or any(n.lower() in m.name.lower() for n in names)]
    missed = 0
    for mutation in chosen:
        verdict, seconds, last = run(mutation)
        missed += verdict.startswith("MISSED")
        print(f"{mutation.name:55s} {verdict:28s} {seconds:6.1f} s  {last}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
