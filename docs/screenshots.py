"""The README's screenshots of the explorer: a neuron page and a trace with an edit, taken with Playwright.

    python docs/screenshots.py --atlas ATLAS [--neuron 23:669] [--prompt "..."] [--edit 23:669=40]

``ATLAS``: an atlas of smollm2-135m (e.g. ``kvmem scan --model smollm2-135m --corpus pydoc --max-tokens 100000``);
its model loads as the explorer loads it. The default neuron, 23:669, fires on "do" and "does" before "not" and its
value promotes " not"; set to 40 at the last token, it turns the default prompt's continuation into a negation.
Writes ``docs/figures/explorer-neuron.png`` and ``docs/figures/explorer-trace.png`` (the top of each page, 1280
pixels wide). Needs Debian's Chromium.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from urllib.parse import urlencode

import kvmem

FIGURES = Path(__file__).resolve().parent / "figures"
CHROMIUM = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--atlas", required=True)
    parser.add_argument("--neuron", default="23:669", help="LAYER:NEURON of the neuron page")
    parser.add_argument("--edit", default="23:669=40", help="the trace's edit, LAYER:NEURON=VALUE (mode set)")
    parser.add_argument("--prompt", default="It is")
    parser.add_argument("--height", type=int, default=1300, help="pixels of each page kept")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    layer, neuron = (int(x) for x in args.neuron.split(":"))
    running = kvmem.explore(args.atlas)
    try:
        if running.model.wait(600) != "ready":
            raise SystemExit(f"the model did not load: {running.model.message}")
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM)
            page = browser.new_page(viewport={"width": 1280, "height": args.height}, device_scale_factor=1)
            page.set_default_timeout(900_000)  # a trace with two generations on a busy CPU
            page.goto(f"{running.url}neuron/{layer}/{neuron}")
            page.screenshot(path=FIGURES / "explorer-neuron.png")
            query = urlencode({"prompt": args.prompt, "top": 3, "generate": 1, "max_new_tokens": 12,
                               "edit": args.edit, "mode": "set"})
            page.goto(f"{running.url}trace?{query}")
            page.screenshot(path=FIGURES / "explorer-trace.png")
            browser.close()
    finally:
        running.stop()
    print(f"wrote {FIGURES / 'explorer-neuron.png'} and {FIGURES / 'explorer-trace.png'}")


if __name__ == "__main__":
    main()
