"""Open exported reports in headless Chromium (file://, offline): no console message, content renders, not blank.

Skipped only when no Chromium is installed (CI installs it: ``apt-get install -y chromium``).
Set ``KVMEM_SCREENSHOT_DIR`` to keep the screenshots for a look.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from html_dom import Elements as Dom

import kvmem
from kvmem.report import export_many

BROWSER = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome") if shutil.which(name)),
               None)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="Chromium is not installed (apt-get install -y chromium)")

CORPUS = ["Plain words first. <script>alert(1)</script> then more plain words follow here. " * 4,
          'A quote "><img src=x onerror=alert(1)> and an ampersand &amp; stay text. ' * 4,
          "Odd \u202eevil\u202c text and zero\u200bwidth space; done. " * 4,
          "The cat sat on the mat. It was a sunny day in Paris, and the river ran slowly east. " * 6]


def chromium(url: str, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    """One headless run; console messages go to stderr (``--enable-logging=stderr``)."""
    command = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
               f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *extra, url]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, errors="replace", check=False)


def console(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]




@pytest.fixture(scope="module")
def reports(gpt2_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    atlas = kvmem.scan(gpt2_model, CORPUS, out=root / "atlas", top_k=5, window=64, per_document=True, progress=False)
    frame = atlas.neurons.sort_values("max", ascending=False)
    slots = [(int(r.layer), int(r.neuron)) for r in frame.drop_duplicates("layer").itertuples()]
    marked = atlas.search(r"<script>|<img", limit=1)  # a slot whose triggers hold the hostile markup
    slots += [(int(marked.layer[0]), int(marked.neuron[0]))]
    index = export_many(atlas, slots, format="html", out=root / "reports", progress=False)
    return atlas, slots, index


def test_report_renders_cleanly(reports, tmp_path):
    atlas, slots, index = reports
    layer, neuron = slots[-1]
    page = index.parent / f"L{layer}_N{neuron}.html"
    shot = tmp_path / "report.png"
    result = chromium(page.as_uri(), tmp_path / "profile", "--window-size=1100,1800", f"--screenshot={shot}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert console(result) == []
    dom = chromium(page.as_uri(), tmp_path / "profile", "--dump-dom")
    assert console(dom) == []
    parsed = Dom(dom.stdout)
    names = [tag for tag, _ in parsed.tags]
    assert "script" not in names and names.count("img") == 2 + len(atlas.conventions)
    assert all(attrs["src"].startswith("data:image/png;base64,") for tag, attrs in parsed.tags if tag == "img")
    assert not [attrs for _, attrs in parsed.tags if any(name.startswith("on") for name in attrs)]
    shown = "".join(parsed.text)
    assert f"Neuron {layer}:{neuron}" in shown and atlas.manifest.model["fingerprint"] in shown
    assert re.search(r"<script>|<img src=x", shown), "the hostile corpus text should render as visible text"
    _assert_not_blank(shot)


def test_index_sorts_and_links(reports, tmp_path):
    atlas, slots, index = reports
    result = chromium(index.as_uri(), tmp_path / "profile", "--window-size=1000,600", f"--screenshot={tmp_path / 'i.png'}")
    assert console(result) == [], console(result)
    _assert_not_blank(tmp_path / "i.png")
    stats = atlas.neurons.set_index(["layer", "neuron"])
    for fragment, key, descending in [("#sort=max", "max", True), ("#sort=frac_positive-asc", "frac_positive", False),
                                      ("#sort=layer-asc", "layer", False)]:
        dom = chromium(index.as_uri() + fragment, tmp_path / "profile", "--dump-dom")
        assert console(dom) == []
        links = [attrs["href"] for tag, attrs in Dom(dom.stdout).tags if tag == "a"]
        pairs = [tuple(int(x) for x in re.findall(r"\d+", link)) for link in links]
        assert sorted(pairs) == sorted(slots)
        values = [stats.loc[pair, key] if key != "layer" else pair[0] for pair in pairs]
        assert values == sorted(values, reverse=descending), (fragment, values)
        assert all((index.parent / link).is_file() for link in links)


def _assert_not_blank(path: Path) -> None:
    from matplotlib import image

    pixels = image.imread(path)[..., :3]  # [height, width, rgb] floats in 0..1
    assert pixels.shape[0] > 300 and pixels.shape[1] > 600
    ink = (pixels.mean(axis=2) < 0.6).mean()
    assert pixels.std() > 0.05 and 0.01 < ink < 0.5, (pixels.std(), ink)
    assert len(np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0)) > 50  # text, figures, shading
    keep = os.environ.get("KVMEM_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(keep) / f"{path.parent.name}-{path.name}")
