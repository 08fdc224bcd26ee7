"""The explorer as a person sees it: Playwright driving Debian's Chromium against the real ``kvmem serve``.

Every page load records each request (none may leave the server), each dialog (none may open) and each
console error (a Content-Security-Policy violation is one). Screenshots go to the test's temporary folder
(``KVMEM_SCREENSHOT_DIR`` keeps a copy). Skipped only when Chromium is not installed.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pyarrow.parquet as pq
import pytest

import kvmem
from kvmem.report.safe_text import visible

CHROMIUM = next((path for path in ("/usr/bin/chromium", shutil.which("chromium") or "") if path and Path(path).exists()),
                None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install -y chromium)")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--no-first-run"]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield chromium
        chromium.close()


class Watch:
    """What a page did besides rendering: requests, dialogs, console errors."""

    def __init__(self, page, base: str):
        self.base, self.requests, self.dialogs, self.errors = base, [], [], []
        page.on("request", lambda request: self.requests.append(request.url))
        page.on("dialog", lambda dialog: (self.dialogs.append(dialog.message), dialog.dismiss()))
        page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        page.on("pageerror", lambda error: self.errors.append(str(error)))

    def check(self) -> None:
        outside = [url for url in self.requests if not url.startswith(self.base) and not url.startswith("data:")]
        assert outside == [], outside
        assert self.dialogs == [], self.dialogs
        assert self.errors == [], self.errors


@pytest.fixture
def page(browser, explorer_server):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    watch = Watch(page, explorer_server.url)
    page.watch = watch
    yield page
    context.close()
    watch.check()


def shot(page, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=path, full_page=True)
    assert path.stat().st_size > 10_000
    keep = os.environ.get("KVMEM_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(keep) / f"explorer-{name}.png")
    return path


HOSTILE_PATTERN = r"<script>|<img|\u202e|\u200b"


def _hostile_neurons(atlas_path: Path) -> list[tuple[int, int]]:
    """Neurons with a kept trigger (of any kind) in the hostile documents, those in top triggers first."""
    atlas = kvmem.open(atlas_path)
    pairs = []
    for kind in ("top", "bottom", "top_doc", "bottom_doc"):
        hits = atlas.search(HOSTILE_PATTERN, kind=kind, limit=1000)
        pairs += [(int(r.layer), int(r.neuron)) for r in hits.itertuples() if (int(r.layer), int(r.neuron)) not in pairs]
    assert pairs, "the hostile documents should hold some kept trigger"
    return pairs


def test_neuron_page_shows_what_the_atlas_holds(page, explorer_server, explorer_atlas, tmp_path):
    layer, neuron = _hostile_neurons(explorer_atlas)[0]
    atlas = kvmem.open(explorer_atlas)
    page.goto(f"{explorer_server.url}neuron/{layer}/{neuron}")
    assert page.inner_text("#neuron-title") == f"Neuron {layer}:{neuron}"
    stats = atlas.neurons.set_index(["layer", "neuron"]).loc[(layer, neuron)]
    for key in ("mean", "std", "min", "max", "key_norm", "value_norm"):
        assert page.inner_text(f'#stats td[data-key="{key}"]') == format(float(stats[key]), ".4g"), key
    assert page.inner_text('#stats td[data-key="count"]') == f"{int(stats['count']):,}"
    assert page.inner_text('#stats td[data-key="frac_positive"]') == f"{stats['frac_positive']:.1%}"
    for kind in ("top", "bottom"):
        expected = atlas.triggers(layer, neuron, kind=kind).sort_values("rank")
        rows = page.locator(f"#triggers-{kind} tr[data-rank]")
        assert rows.count() == len(expected)
        assert rows.locator("td.m").all_inner_texts() == [format(float(a), ".4g") for a in expected.activation]
        # each context shows its tokens in order, the trigger outlined, every token titled with its own m
        for i, row in enumerate(expected.itertuples()):
            tokens = rows.nth(i).locator(".ctx .t")
            assert "".join(tokens.all_inner_texts()) == visible("".join(row.context_tokens))  # newlines as ↵
            trigger = rows.nth(i).locator(".ctx .trig").all_inner_texts()
            assert "".join(trigger) == visible(row.context_tokens[row.context_trigger])
            titles = [tokens.nth(j).get_attribute("title") for j in range(tokens.count())]
            assert all(t is not None and t.startswith("m = ") for t in titles)
    # the robust scale: the median top trigger is at full colour, so most top triggers are strongly shaded
    top = page.locator("#triggers-top .ctx .trig")
    strong = sum(bool(re.search(r"\bp[5-8]\b", top.nth(i).get_attribute("class"))) for i in range(top.count()))
    assert strong >= math.ceil(top.count() / 2)
    for convention in atlas.conventions:
        promoted = atlas.values(layer, neuron, convention=convention, kind="promote").sort_values("rank")
        cells = page.locator(f"#values-{convention} tr td:nth-child(2)").all_inner_texts()
        assert cells == [_chip(t) for t in promoted.token]
    histogram = atlas.histogram(layer, neuron)
    assert page.locator("#histogram rect.bar").count() == _shown_bins(histogram["count"].tolist())
    assert page.locator("#quadrant-table tr").count() == 5
    shot(page, tmp_path, "neuron")
    page.click("#next-neuron")
    page.wait_for_url(f"**/neuron/{layer}/{neuron + 1}" if neuron + 1 < atlas.d_ff else "**")
    page.keyboard.press("ArrowLeft")  # the one script: arrow keys step between neighbours
    page.wait_for_url(f"**/neuron/{layer}/{neuron}")


def _visible(text: str) -> str:
    """Text as a faithful page shows it: every character visible, a newline as ↵ and a line break."""
    return "↵\n".join(visible(part) for part in text.split("\n"))


def _chip(token: str) -> str:
    if token and token.strip() == "":
        return "".join("␣" if c == " " else visible(c) if c in "\n\t\r" else f"⟨U+{ord(c):04X}⟩" for c in token)
    return visible(token)


def _shown_bins(counts: list[int]) -> int:
    nonzero = [i for i, c in enumerate(counts) if c > 0]
    return min(nonzero[-1] + 1, len(counts) - 1) - max(nonzero[0] - 1, 0) + 1


def test_search_then_click_through_to_a_neuron(page, explorer_server, explorer_atlas, tmp_path):
    manifest = kvmem.open(explorer_atlas).manifest
    convention = manifest.projection["default_convention"]
    values = pq.read_table(explorer_atlas / "values.parquet").to_pandas()
    promoted = values[(values.convention == convention) & (values.kind == "promote")]
    token = promoted.token.value_counts().index[0]
    expected = promoted[promoted.token == token].groupby(["layer", "neuron"]).score.max().sort_values(ascending=False)
    page.goto(f"{explorer_server.url}search")
    page.select_option("#by", "promotes")
    page.fill("#q", token)
    page.fill('input[name="per_page"]', "500")
    page.click("#search-button")
    page.wait_for_selector("#results")
    links = page.locator("#results td:first-child a")
    shown = [tuple(int(x) for x in re.findall(r"\d+", text)) for text in links.all_inner_texts()]
    assert set(shown) >= set(expected.index)  # the exact token, and those equal to it once spaces are dropped
    exact = [pair for pair in shown if pair in set(expected.index)]
    assert exact == list(expected.index)  # in score order
    assert parse_qs(urlparse(page.url).query)["q"] == [token]  # a shareable URL
    shot(page, tmp_path, "search")
    first = links.first.inner_text()
    links.first.click()
    page.wait_for_url("**/neuron/**")
    assert page.inner_text("#neuron-title") == f"Neuron {first}"


def test_trace_a_prompt_switch_a_memory_off_and_generate(page, explorer_server, tmp_path):
    explorer_server.wait_model()
    page.goto(f"{explorer_server.url}trace")
    page.fill("#prompt", "The cat sat on the")
    page.click("#trace-button")
    page.wait_for_selector("#layer-table")
    assert page.locator("#layer-table tr[data-layer]").count() == 2
    _, trace = explorer_server.json(f"/api/trace?{urlparse(page.url).query}")
    assert page.locator("#next-tokens tr td:nth-child(2)").first.inner_text() == _chip(trace["next_tokens"][0]["token"])
    shot(page, tmp_path, "trace")
    box = page.locator('#layer-table input[name="off"]').first
    off = box.get_attribute("value")
    box.check()
    page.check('input[name="generate"]')
    page.click("#trace-button")
    page.wait_for_selector("#gen-with")
    query = parse_qs(urlparse(page.url).query)
    assert query["off"] == [off] and query["generate"] == ["1"]  # the edit is in the URL
    _, edited = explorer_server.json(f"/api/trace?{urlparse(page.url).query}")
    assert page.inner_text("#gen-without") == _visible(edited["generation"]["without"])
    assert page.inner_text("#gen-with") == _visible(edited["generation"]["with"])
    assert page.is_checked(f'#layer-table input[value="{off}"]')
    shot(page, tmp_path, "trace-edited")
    page.goto(page.url)  # the shared link shows the same edit
    assert page.inner_text("#gen-with") == _visible(edited["generation"]["with"])


def test_hostile_corpus_and_prompt_raise_no_dialog(page, explorer_server, explorer_atlas, tmp_path):
    seen = ""
    for layer, neuron in _hostile_neurons(explorer_atlas)[:6]:
        page.goto(f"{explorer_server.url}neuron/{layer}/{neuron}")
        for summary in page.locator("#triggers details summary").all():
            summary.click()  # open the per-document triggers too
        seen += page.inner_text("#triggers")
    assert "<script>" in seen or "<img" in seen or "onerror" in seen  # the markup shows as text
    assert page.locator("#triggers script, #triggers img").count() == 0
    assert "⟨U+202E⟩" in seen or "⟨U+200B⟩" in seen  # invisible characters shown as markers
    page.goto(f"{explorer_server.url}search?by=context&q=%3Cscript%3E%7C%3Cimg%7C%E2%80%AE%7C%E2%80%8B&side=bottom")
    shot(page, tmp_path, "hostile-search")
    explorer_server.wait_model()
    prompt = "<script>alert(1)</script><img src=x onerror=alert(1)> \u202eevil\u202c zero\u200bwidth"
    page.goto(f"{explorer_server.url}trace")
    page.fill("#prompt", prompt)
    page.click("#trace-button")
    page.wait_for_selector("#prompt-tokens")
    tokens = page.inner_text("#prompt-tokens")
    assert "⟨U+200B⟩" in tokens and "\u202e" not in tokens  # no character reorders the page's text
    assert page.input_value("#prompt") == prompt
    page.goto(f"{explorer_server.url}neuron/0/0?x=%3Cscript%3Ealert(1)%3C/script%3E")
    errors = len(page.watch.errors)
    response = page.goto(f"{explorer_server.url}nope%3Cscript%3Ealert(1)%3C%2Fscript%3E")
    assert response.status == 404 and "<script>" in page.inner_text("#error-message")
    assert [e for e in page.watch.errors[errors:] if "404" not in e] == []  # the browser logs the 404 itself
    del page.watch.errors[errors:]
    shot(page, tmp_path, "hostile-error")
    assert page.watch.requests, "requests were recorded"


def test_overview_shows_provenance_and_plots(page, explorer_server, explorer_atlas, tmp_path):
    manifest = kvmem.open(explorer_atlas).manifest
    page.goto(explorer_server.url)
    provenance = page.inner_text("#provenance")
    assert manifest.model["fingerprint"] in provenance and f"{manifest.tokens:,}" in provenance
    assert page.locator("svg.chart").count() == 4  # density, norms, taxonomy classes, explanation scores
    shot(page, tmp_path, "overview")
    page.select_option('select[name="layer"]', "1")
    page.click("text=List neurons")
    page.wait_for_selector("#results")
    assert page.locator("#results td:first-child a").count() == 50
    page.click("#next-page")
    page.wait_for_url("**page=2**")
    assert page.locator("#results td:first-child a").count() == kvmem.open(explorer_atlas).d_ff - 50
