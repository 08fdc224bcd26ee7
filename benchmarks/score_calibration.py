"""Calibration of the explanation scores: interval coverage under an exact null, p-values under scrambled explanations.

    python benchmarks/score_calibration.py --atlas ATLAS [--layers 0,15,29] [--every 7] [--reps 2] [--out FILE]

On real sides of an atlas (every ``--every``-th neuron of the given layers, both sides when gated),
with the ``tokens`` explainer's rules (explained first if the atlas has none) and the ``tokens`` judge:

1. **Exact null.** Each scorer's task is built from the side's held-out examples and answered with the
   side's own rule; then the answers are re-paired with the examples at random, in the scorer's own
   exchangeable unit (detection, output: answers permuted over examples; fuzzing: the two labels of an
   example swapped with probability 1/2; simulation: prediction records permuted among records of the
   same length). The answers then carry no information, and the true score is chance (0.5; 0 for
   simulation). Printed per scorer: the share of 95% intervals that hold chance (target 0.95), the share
   of paired score-minus-baseline intervals that hold 0 (the baseline re-paired independently), and the
   share of p < 0.05 (target at most 0.05).
2. **Scrambled explanations.** Each side is judged with another side's rule (a derangement within
   its layer and side, as ``kvmem score``'s baseline): the share of p < 0.05 (the issue's bound: at most
   0.10; 0.05 plus whatever real overlap the borrowed rules have with the side).

It also prints the percentile bootstrap's coverage of simulation (the interval kvmem used before) for
comparison. Results go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import namedtuple
from pathlib import Path

import numpy as np

Row = namedtuple("Row", "layer neuron side text rule")
CHANCE = {"detection": 0.5, "fuzzing": 0.5, "output": 0.5, "simulation": 0.0}


def _repair(module, task, answers, rng):
    """The answers re-paired with the task's examples at random, in the scorer's exchangeable unit."""
    if module.NAME == "simulation":
        lengths = np.asarray([len(t) for t in task.truth])
        order = np.arange(len(lengths))
        for length in np.unique(lengths):
            where = np.flatnonzero(lengths == length)
            order[where] = rng.permutation(where)
        return [answers[j] for j in order]
    if module.NAME == "fuzzing":
        out = list(answers)
        groups = np.asarray(task.group)
        for g in np.unique(groups):
            where = np.flatnonzero(groups == g)
            if rng.random() < 0.5:
                out[where[0]], out[where[1]] = out[where[1]], out[where[0]]
        return out
    return [answers[j] for j in rng.permutation(len(answers))]


def _percentile_simulation(task, answers, *, n_boot: int, seed: int):
    from kvmem.autointerp.scorers.intervals import bootstrap, moment_sums, pearson_from

    predicted, truth = np.concatenate([np.asarray(a, float) for a in answers]), np.concatenate(task.truth)
    groups = np.repeat(np.asarray(task.group), [len(t) for t in task.truth])
    return bootstrap(pearson_from, moment_sums(predicted, truth, groups), n_boot=n_boot, seed=seed)


def main(argv=None) -> int:
    import kvmem
    from kvmem.autointerp.bulk import layer_evidence
    from kvmem.autointerp.judges import TokensJudge
    from kvmem.autointerp.scorers import SCORERS
    from kvmem.experiments.stats import single_cycle

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atlas", required=True)
    parser.add_argument("--layers", default=None, help="layers (default: first, middle, last of the atlas)")
    parser.add_argument("--every", type=int, default=7, help="every N-th neuron")
    parser.add_argument("--reps", type=int, default=2, help="random re-pairings per side under the exact null")
    parser.add_argument("--n-boot", type=int, default=1000)
    parser.add_argument("--scorers", default="detection,fuzzing,simulation,output")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    atlas = kvmem.open(args.atlas)
    layers = [int(x) for x in args.layers.split(",")] if args.layers else \
        sorted({atlas.layers[0], atlas.layers[len(atlas.layers) // 2], atlas.layers[-1]})
    neurons = list(range(0, atlas.d_ff, args.every))
    names = [n.strip() for n in args.scorers.split(",")]
    start = time.perf_counter()
    stored = kvmem.explain(atlas, neurons=[(layer, n) for layer in layers for n in neurons])
    rules = {(int(r.layer), int(r.neuron), r.side): Row(int(r.layer), int(r.neuron), r.side, r.text, r.rule)
             for r in stored.itertuples()}
    judge = TokensJudge()
    rng = np.random.default_rng(0)
    tally = {n: {"cover": [], "cover_diff": [], "null_p": [], "scrambled_p": [], "percentile_cover": []}
             for n in names}
    sides = 0
    for layer in layers:
        found = layer_evidence(atlas, layer, neurons, seed=0, held_out=0.5)
        keys = [(layer, n, s.side) for n in neurons for s in found[n]]
        lender = {}
        for side_name in {k[2] for k in keys}:
            group = [k for k in keys if k[2] == side_name]
            cycle = single_cycle(len(group), np.random.default_rng([layer, len(side_name)]))
            lender.update({k: group[j] for k, j in zip(group, cycle)})
        for n in neurons:
            for side in found[n]:
                sides += 1
                key = (layer, n, side.side)
                for name in names:
                    module = SCORERS[name]
                    task = module.build(side)
                    if len(task.codes) < 5:
                        continue
                    own = judge.answer([(rules[key], name, q) for q in task.queries])
                    borrowed = judge.answer([(rules[lender[key]], name, q) for q in task.queries])
                    scrambled = module.evaluate(task, borrowed, seed=0, n_boot=args.n_boot)
                    if np.isfinite(scrambled.p):
                        tally[name]["scrambled_p"].append(scrambled.p)
                    for rep in range(args.reps):
                        null_own = _repair(module, task, own, rng)
                        result = module.evaluate(task, null_own, seed=rep, n_boot=args.n_boot)
                        if np.isfinite(result.low):
                            tally[name]["cover"].append(result.low <= CHANCE[name] <= result.high)
                        if np.isfinite(result.p):
                            tally[name]["null_p"].append(result.p)
                        null_base = _repair(module, task, borrowed, rng)
                        low, high = module.paired(task, null_own, null_base, seed=rep, n_boot=args.n_boot)
                        if np.isfinite(low):
                            tally[name]["cover_diff"].append(low <= 0 <= high)
                        if name == "simulation":
                            low, high = _percentile_simulation(task, null_own, n_boot=args.n_boot, seed=rep)
                            if np.isfinite(low):
                                tally[name]["percentile_cover"].append(low <= 0 <= high)
    results = {"atlas": str(atlas.path), "model": atlas.manifest.model["name"], "tokens": atlas.manifest.tokens,
               "layers": layers, "every": args.every, "sides": sides, "reps": args.reps, "n_boot": args.n_boot,
               "seconds": time.perf_counter() - start, "load_average_end": list(os.getloadavg()), "scorers": {}}
    print(f"{results['model']}, {results['tokens']:,} tokens, layers {layers}, every {args.every}th neuron: {sides} "
          f"sides, {args.reps} null re-pairings each, {args.n_boot} replicates")
    print("scorer      | interval holds chance | paired diff holds 0 | p<0.05 under exact null | p<0.05 scrambled")
    for name in names:
        t = {k: np.asarray(v, float) for k, v in tally[name].items()}
        entry = {"coverage": float(t["cover"].mean()), "coverage_n": int(len(t["cover"])),
                 "diff_coverage": float(t["cover_diff"].mean()), "diff_n": int(len(t["cover_diff"])),
                 "null_p05": float((t["null_p"] < 0.05).mean()), "null_n": int(len(t["null_p"])),
                 "scrambled_p05": float((t["scrambled_p"] < 0.05).mean()), "scrambled_n": int(len(t["scrambled_p"]))}
        if len(t["percentile_cover"]):
            entry["percentile_bootstrap_coverage"] = float(t["percentile_cover"].mean())
        results["scorers"][name] = entry
        extra = f" (percentile bootstrap: {entry['percentile_bootstrap_coverage']:.3f})" \
            if "percentile_bootstrap_coverage" in entry else ""
        print(f"{name:<11} | {entry['coverage']:.3f} of {entry['coverage_n']}{extra} | {entry['diff_coverage']:.3f} of "
              f"{entry['diff_n']} | {entry['null_p05']:.3f} of {entry['null_n']} | {entry['scrambled_p05']:.3f} of "
              f"{entry['scrambled_n']}")
    print(f"{results['seconds']:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
