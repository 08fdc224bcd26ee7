"""The explorer's server time on a real atlas, and how it grows with the number of neurons.

Starts the real ``kvmem serve --no-model`` in a subprocess and reads each answer's ``Server-Timing`` header
(the time the application took, without the HTTP round trip). Per sampled neuron it alternates the neuron
page, its JSON (``/api/neuron``) and, in this process, the baseline: the same neuron's ``kvmem.neuron/1``
record through the Python API (``Atlas.neuron`` + ``kvmem.report.neuron_data``, what ``kvmem report
--format json`` computes), and for a few neurons the static HTML report with its figures. Each search kind
is alternated with the Python API's nearest query (``Atlas.top_neurons``, ``Atlas.search``).

It also cuts the atlas into atlases of its first L layers (the same row groups, the same contexts) and
serves them all at once: each round asks every server in turn, so the host's load weighs on every size
alike. Per size: the pages and searches, the index build time and the server's memory; then a fit
a + b * neurons, extrapolated to a Llama-3.1-8B atlas (32 x 14,336 = 458,752 neurons).

    python benchmarks/explorer.py --atlas ATLAS [--samples 40] [--layers 4,8,15,30]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from common import machine

import kvmem

LLAMA_8B = 32 * 14336
ROOT = Path(__file__).resolve().parents[1]


class Server:
    def __init__(self, atlas: Path):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        start = time.perf_counter()
        self.process = subprocess.Popen([sys.executable, "-m", "kvmem", "serve", "--atlas", str(atlas), "--no-model",
                                         "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                        env=env)
        line = self.process.stdout.readline()
        self.startup = time.perf_counter() - start  # process start, imports, atlas open, URL printed
        self.url = re.search(r"(http://\S+/)", line).group(1).rstrip("/")
        while True:  # the search index is built in the background: wait for it
            status = json.loads(self.get("/api/status")[1])
            if "triggers" in status["atlas"]["index_seconds"]:
                self.index_seconds = sum(status["atlas"]["index_seconds"].values())
                break
            time.sleep(0.2)

    def get(self, path: str) -> tuple[float, bytes]:
        """(server time in ms, body)."""
        with urllib.request.urlopen(self.url + path, timeout=300) as response:
            body = response.read()
            timing = response.headers.get("server-timing", "")
        return float(re.search(r"dur=([0-9.]+)", timing).group(1)), body

    def memory_mb(self) -> tuple[float, float]:
        """(resident now, peak resident) of the server process."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        kb = {line.split(":")[0]: int(line.split()[1]) for line in status.splitlines() if line.startswith(("VmRSS", "VmHWM"))}
        return kb["VmRSS"] / 1024, kb["VmHWM"] / 1024

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 1)


def searches(atlas) -> dict[str, str]:
    """The search kinds, with a query each (tokens common in this atlas)."""
    values = atlas.values(atlas.layers[-1], 0, kind="promote")
    triggers = atlas.triggers(atlas.layers[0], 0, kind="top")
    out = {
        "browse all, by max": "/api/search?by=all",
        "browse one layer": f"/api/search?by=all&layer={atlas.layers[0]}&sort=frac_positive",  # in every cut
        "promotes a token": f"/api/search?by=promotes&q=%23{int(values.token_id.iloc[0])}",
        "fires on a token": f"/api/search?by=fires&q=%23{int(triggers.token_id.iloc[0])}",
        "precedes a token": "/api/search?by=precedes&q=%20the",
        "regex over contexts": "/api/search?by=context&q=%5Cbassert%5Cb",
    }
    if (atlas.path / "taxonomy.parquet").exists():
        out["taxonomy class"] = "/api/search?by=class&q=rare"
    if (atlas.path / "explanations.parquet").exists():
        out["explanation text"] = "/api/search?by=explanation&q=token"
    return out


def measure(paths: dict[int, Path], samples: int) -> dict[int, dict]:
    """Every atlas served at once; each round asks every server in turn (rotating the order), so the host's
    load weighs on all sizes alike. The Python API baselines run in this process, alternated with the pages
    of the whole atlas (the largest key)."""
    from kvmem.report.neuron_dict import neuron_data

    whole = max(paths)
    atlases = {n: kvmem.open(path) for n, path in paths.items()}
    servers = {}
    try:
        for n, path in paths.items():
            servers[n] = Server(path)
        results = {n: {"neurons": n, "startup_s": round(servers[n].startup, 2), "index_s": round(servers[n].index_seconds, 2),
                       "pages": [], "apis": [], "search": {}} for n in paths}
        rng = random.Random(0)
        records, reports, base_search = [], [], {}
        order = list(paths)
        for n in order:
            servers[n].get("/neuron/0/0")
        for i in range(samples):
            layer, neuron = rng.choice(atlases[min(paths)].layers), rng.randrange(atlases[whole].d_ff)  # in every cut
            order = order[1:] + order[:1]
            for n in order:
                results[n]["pages"].append(servers[n].get(f"/neuron/{layer}/{neuron}")[0])
                results[n]["apis"].append(servers[n].get(f"/api/neuron/{layer}/{neuron}")[0])
                if n == whole:
                    start = time.perf_counter()
                    neuron_data(atlases[whole], layer, neuron)
                    records.append((time.perf_counter() - start) * 1000)
            if i < 3:
                start = time.perf_counter()
                kvmem.report.export_neuron(atlases[whole], layer, neuron, format="html", out=tempfile.mkdtemp())
                reports.append((time.perf_counter() - start) * 1000)
        atlas = atlases[whole]
        token = int(atlas.values(atlas.layers[-1], 0, kind="promote").token_id.iloc[0])
        python = {"promotes a token": lambda: atlas.top_neurons(token=token, by="value", k=50),
                  "precedes a token": lambda: atlas.top_neurons(token=" the", by="trigger", k=50),
                  "regex over contexts": lambda: atlas.search(r"\bassert\b", limit=50)}
        for name, path in searches(atlas).items():
            times = {n: [] for n in paths}
            base = []
            for _ in range(max(samples // 4, 5)):
                order = order[1:] + order[:1]
                for n in order:
                    times[n].append(servers[n].get(path)[0])
                if name in python:
                    start = time.perf_counter()
                    python[name]()
                    base.append((time.perf_counter() - start) * 1000)
            for n in paths:
                results[n]["search"][name] = _median(times[n])
            if base:
                base_search[name] = _median(base[1:])  # its first call builds its caches
        for n, server in servers.items():
            r = results[n]
            r["neuron_page_ms"], r["neuron_api_ms"] = _median(r.pop("pages")), _median(r.pop("apis"))
            r["search_ms"] = r.pop("search")
            r["search_worst_ms"] = max(r["search_ms"].values())
            r["server_rss_mb"], r["server_peak_mb"] = (round(x) for x in server.memory_mb())
        results[whole]["baseline_record_ms"] = _median(records)
        results[whole]["baseline_static_report_ms"] = _median(reports)
        results[whole]["baseline_search_ms"] = base_search
    finally:
        for server in servers.values():
            server.stop()
    return results


def cut(source: Path, target: Path, layers: int) -> Path:
    """An atlas of ``source``'s first ``layers`` layers: the same row groups of each table, the rest linked."""
    import pyarrow.compute as pc

    target.mkdir(parents=True)
    manifest = json.loads((source / "manifest.json").read_text())
    kept = manifest["layers"][:layers]
    for path in source.iterdir():
        if path.suffix != ".parquet":
            if path.is_file() and path.name != "manifest.json":
                shutil.copy(path, target / path.name)
            continue
        file = pq.ParquetFile(path)
        if "layer" not in file.schema_arrow.names:
            try:
                os.link(path, target / path.name)
            except OSError:  # another file system
                shutil.copy(path, target / path.name)
            continue
        if path.name in ("taxonomy.parquet", "explanations.parquet"):
            table = pq.read_table(path)
            keep = pc.is_in(table.column("layer"), value_set=pa.array(kept, table.schema.field("layer").type))
            pq.write_table(table.filter(keep), target / path.name)
            continue
        with pq.ParquetWriter(target / path.name, file.schema_arrow) as writer:
            index = file.schema_arrow.names.index("layer")
            for group in range(file.metadata.num_row_groups):
                stats = file.metadata.row_group(group).column(index).statistics
                if stats is not None and stats.min in kept:
                    writer.write_table(file.read_row_group(group))
    manifest["layers"] = kept
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target


def uncompressed_mb(path: Path) -> float:
    meta = pq.ParquetFile(path).metadata
    return sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--atlas", required=True)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--layers", default="4,8,15", help="layer counts of the cut atlases (the whole one is added)")
    args = parser.parse_args()
    source = Path(args.atlas)
    atlas = kvmem.open(source)
    print(machine())
    print(f"atlas {source.name}: {atlas.manifest.model['name']}, {len(atlas.layers)} x {atlas.d_ff} neurons, "
          f"{atlas.manifest.tokens:,} tokens; triggers table {uncompressed_mb(source / 'triggers.parquet'):.0f} MB and "
          f"samples {uncompressed_mb(source / 'samples.parquet'):.0f} MB uncompressed")
    with tempfile.TemporaryDirectory(prefix="kvmem-explorer-bench-") as folder:
        paths = {count * atlas.d_ff: cut(source, Path(folder) / f"L{count}", count)
                 for count in [int(x) for x in args.layers.split(",") if int(x) < len(atlas.layers)]}
        paths[len(atlas.layers) * atlas.d_ff] = source
        results = measure(paths, args.samples)
    rows = [results[n] for n in sorted(results)]
    full = rows[-1]
    print(json.dumps(full, indent=1))
    print("\nneurons | page ms | api ms | worst search ms | index s | server RSS MB | peak MB")
    for r in rows:
        print(f"{r['neurons']:>7,} | {r['neuron_page_ms']:>7} | {r['neuron_api_ms']:>6} | {r['search_worst_ms']:>15} | "
              f"{r['index_s']:>7} | {r['server_rss_mb']:>13} | {r['server_peak_mb']:>7}")
    print("\nfit a + b * neurons (least squares over the rows above), extrapolated to Llama-3.1-8B (458,752 neurons):")
    xs = [r["neurons"] for r in rows]
    for key in ("neuron_page_ms", "search_worst_ms", "index_s", "server_rss_mb"):
        a, b = _fit(xs, [r[key] for r in rows])
        print(f"  {key}: {a:.4g} + {b * 1000:.4g} per 1,000 neurons -> {a + b * LLAMA_8B:,.1f} at 458,752")
    for name in full["search_ms"]:
        a, b = _fit(xs, [r["search_ms"].get(name, float("nan")) for r in rows])
        print(f"  search {name}: {a:.4g} + {b * 1000:.4g} ms per 1,000 neurons -> {a + b * LLAMA_8B:,.0f} ms")
    print(json.dumps({"full": full, "scaling": rows}))


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs) or 1.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    return my - b * mx, b


if __name__ == "__main__":
    main()
