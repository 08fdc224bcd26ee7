"""Run every benchmark in its own process and print the markdown table for benchmarks/README.md.

    python benchmarks/run_all.py [--quick]     # --quick: smaller token counts (a smoke run)
"""

from __future__ import annotations

import argparse
import json

from common import HERE, machine, run_isolated


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default=None, help="rerun some sections (command,whole,overhead,memory,projection,queries), "
                                                       "keeping the others from results.json")
    args = parser.parse_args()
    small, large = (2_000, 6_000) if args.quick else (10_000, 100_000)
    overhead_tokens = "2048" if args.quick else "8192"
    sections = {
        "command": lambda: [run_isolated("whole_command.py", "--model", "smollm2-135m", "--tokens", str(n),
                                         "--rounds", "3") for n in ((2_000,) if args.quick else (2_000, 20_000))],
        "whole": lambda: [run_isolated("whole_scan.py", "--model", "smollm2-135m", "--tokens", str(n),
                                       "--repeats", "1" if n >= 100_000 else "2", *(["--cold"] if n == 2_000 else []))
                          for n in ((2_000, 6_000) if args.quick else (2_000, 20_000, 100_000))],
        "overhead": lambda: [run_isolated("scan_overhead.py", "--model", m, "--tokens", overhead_tokens)
                             for m in ("gpt2-random", "smollm2-135m")],
        "memory": lambda: [run_isolated("naive_vs_kvmem.py", "--mode", mode, "--tokens", str(n))
                           for n in (small, large) for mode in ("kvmem", "naive")],
        "projection": lambda: [run_isolated("projection.py", "--model", m) for m in ("gpt2-random", "smollm2-135m")],
        "queries": lambda: run_isolated("queries.py"),
    }
    path = HERE / "results.json"
    results = json.loads(path.read_text()) if args.only and path.exists() else {}
    for name in (args.only.split(",") if args.only else sections):
        results[name] = sections[name]()
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"Measured on: {machine()}\n")
    print("| the kvmem scan command from the shell (smollm2-135m, pydoc) | tokens | bare load + forward s | command s "
          "| bare / command |")
    print("|---|---|---|---|---|")
    for r in results.get("command", []):
        print(f"| | {r['tokens']:,} | {r['bare_seconds']} | {r['command_seconds']} | {r['ratio']} |")
    print()
    print("| whole scan (smollm2-135m, pydoc) | tokens | bare forward s | whole scan s | bare / scan | phases s |")
    print("|---|---|---|---|---|---|")
    for r in results.get("whole", []):
        phases = ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items())
        cold = f" (first scan, empty projection cache: {r['first_scan_cold_seconds']} s)" if r["first_scan_cold_seconds"] else ""
        print(f"| | {r['tokens']:,} | {r['bare_seconds']} | {r['scan_seconds']} | {r['ratio']} | {phases}{cold} |")
    print()
    print("| scan overhead | bare forward tok/s | forward to last FFN tok/s | full scan tok/s | scan / bare | scan / truncated |")
    print("|---|---|---|---|---|---|")
    for r in results["overhead"]:
        print(f"| {r['model']} | {r['bare_tok_s']} | {r['truncated_tok_s']} | {r['scan_tok_s']} | "
              f"{r['ratio_vs_bare_forward']} | {r['ratio_vs_truncated_forward']} |")
    print("\n| way (GPT-2 small arch.) | tokens | tok/s | peak RSS MB | RSS after model load MB |")
    print("|---|---|---|---|---|")
    for r in results["memory"]:
        print(f"| {r['mode']} | {r['tokens']:,} | {r['tok_s']} | {r['peak_rss_mb']} | {r['rss_after_load_mb']} |")
    kv = [r for r in results["memory"] if r["mode"] == "kvmem"]
    growth = kv[1]["peak_rss_mb"] / kv[0]["peak_rss_mb"] - 1
    print(f"\nkvmem peak RSS growth from {kv[0]['tokens']:,} to {kv[1]['tokens']:,} tokens: {growth:+.1%}")
    print("\n| projection | rows × vocab | plain GEMM GFLOP/s | kvmem top/bottom-k GFLOP/s | ratio |")
    print("|---|---|---|---|---|")
    for r in results["projection"]:
        print(f"| {r['model']} | {r['rows']:,} × {r['vocab']:,} | {r['gemm_gflops']} | {r['kvmem_gflops']} | {r['ratio']} |")
    q = results["queries"]
    print(f"\nqueries on a {q['slots']:,}-slot atlas ({q['trigger_rows']:,} trigger rows), median ms: "
          f"neuron {q['neuron']}, top_neurons by value {q['top_neurons_value']}, by trigger {q['top_neurons_trigger']} "
          f"(first neuron() call {q['first_neuron_ms']} ms)")


if __name__ == "__main__":
    main()
