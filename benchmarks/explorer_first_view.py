"""Time to the first view of ``captum-transformers explore`` on the built-in model.

The first view is the page with its gallery (48 DigitCanvas test images) and the default
grid (rollout and generic-attention on 6 examples) drawn. Each repeat builds a fresh
workspace, starts the server in this process on a free port, opens a fresh headless Chromium
context and measures, from navigation start (the page's ``performance.now()``), twice: with
the default view computed on the page's request (empty cache), and with it computed by the
server at start (what ``explore`` does) before the page is opened:

* ``gallery``: the gallery drawn (page, script, /api/session, 48 canvases);
* ``first view``: the grid's maps computed (one ``attribute`` call per method) and drawn.

It also times the command itself (``python -m captum_transformers explore --port 0``, which
prints its URL as soon as it listens and loads the model behind it), from process start to:
the URL printed; the page shown (saying the model is loading); the first view drawn. Those
include importing torch, the package and timm, and are reported separately.

Run (needs the ``explorer`` extra, Playwright and Debian's chromium)::

    OMP_NUM_THREADS=1 python benchmarks/explorer_first_view.py --repeats 10 --screenshot docs/images/explorer.png
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def command_seconds(browser) -> tuple:
    """Seconds from spawning ``explore --port 0`` to (URL printed, page shown, first view drawn)."""
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "captum_transformers", "explore", "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in process.stdout:
            if "?token=" in line:
                url = line.split("open ", 1)[1].strip()
                break
        else:
            raise RuntimeError("explore exited without printing its URL")
        printed = time.perf_counter() - start
        page = browser.new_page()
        page.goto(url)
        page.wait_for_selector("#status:has-text('loading'), body[data-ready=yes]", timeout=60_000)
        shown = time.perf_counter() - start
        page.wait_for_selector("body[data-ready=yes]", timeout=120_000)
        drawn = time.perf_counter() - start
        page.close()
        return printed, shown, drawn
    finally:
        process.terminate()
        process.wait(10)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--screenshot", help="save a PNG of the first view (the README's screenshot)")
    parser.add_argument("--skip-command", action="store_true", help="do not time the command's start")
    args = parser.parse_args(argv)

    import torch
    from playwright.sync_api import sync_playwright

    from captum_transformers.explorer.server import start
    from captum_transformers.explorer.pages.classifier.sources import builtin_workspace

    print(f"torch threads: {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
          f"load average: {os.getloadavg()[0]:.2f}")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        if not args.skip_command:
            printed, shown, drawn = command_seconds(browser)
            print(f"from process start: URL printed {printed:.2f} s, page shown (model loading) {shown:.2f} s, "
                  f"first view drawn {drawn:.2f} s")
        for warm in (False, True):
            gallery, first_view, wall = [], [], []
            for repeat in range(args.repeats + 1):  # the first round warms Chromium and the model up
                running = start(builtin_workspace(args.samples), port=0, blocking=False, quiet=True, warm=warm)
                if warm:  # the server computes the default view as soon as it starts; a user opens
                    running.server.config.app.app.state.jobs.wait("job-1")  # the page after that
                context = browser.new_context(viewport={"width": 1180, "height": 820})
                page = context.new_page()
                began = time.perf_counter()
                page.goto(running.url)
                page.wait_for_selector("body[data-ready=yes]", timeout=60_000)
                elapsed = time.perf_counter() - began
                if repeat:
                    gallery.append(float(page.locator("body").get_attribute("data-gallery-ms")) / 1000)
                    first_view.append(float(page.locator("body").get_attribute("data-ready-ms")) / 1000)
                    wall.append(elapsed)
                if warm and repeat == args.repeats and args.screenshot:
                    page.click("#grid tr[data-row=generic-attention] td[data-ready=yes] canvas")  # a curve too
                    page.wait_for_selector("#curve svg")
                    page.screenshot(path=args.screenshot, full_page=True)
                context.close()
                running.stop()
            print("default view cached at start (the command's behaviour):" if warm else
                  "default view computed on the page's request (empty cache):")
            for name, values in (("gallery drawn", gallery), ("first view (gallery + grid)", first_view),
                                 ("goto -> ready, as Playwright sees it", wall)):
                print(f"{name:>38}: median {statistics.median(values):.3f} s, worst {max(values):.3f} s, "
                      f"best {min(values):.3f} s over {len(values)} runs")
        browser.close()
    if args.screenshot:
        try:  # a 256-colour palette keeps the README's PNG small; the view survives it
            from PIL import Image

            with Image.open(args.screenshot) as shot:
                shot.convert("RGB").quantize(256).save(args.screenshot, optimize=True)
        except ImportError:
            pass
        print(f"wrote {args.screenshot} ({os.path.getsize(args.screenshot) // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
