"""Time from a click on an output token of the explorer's generation page to the recoloured view.

Starts the generation page on the built-in recall Llama (the shipped weights; random weights of
the same architecture, said so in the output, while ``assets/recall_llama.pt`` is missing), opens
it in headless Chromium, generates from the first sample prompt with ``--method`` and then clicks
the output tokens in turn (``--clicks`` times, cycling), measuring in the page, from just before
the click:

* ``handler``: until the click's handler returned (the prompt and earlier output recoloured
  from the rows already loaded; no request is made);
* ``painted``: until the next frame after it was painted (two ``requestAnimationFrame``), what a
  person sees; it includes waiting for the frame, up to one display interval.

Run (needs the ``explorer`` extra, Playwright and Debian's chromium)::

    OMP_NUM_THREADS=1 python benchmarks/explorer_generation_click.py --clicks 40

Measured on the shipped weights (2026-11-26, 2 CPU cores with a CI run beside it, headless
Chromium; 3 output x 34 prompt tokens, attn-lrp, 40 clicks): handler median 0.4 ms, worst
1.4 ms; painted median 29.9 ms, worst 31.1 ms.

Earlier (2026-11-26, 2 CPU cores, headless Chromium 1200 x 900, random-weight recall Llama
while the shipped weights were being trained: 16 output tokens x 28 prompt tokens, attn-lrp, 40
clicks): handler median 0.4 ms, worst 1.0 ms; painted median 30.4 ms, worst 31.0 ms (headless
Chromium draws a frame about every 30 ms here). Well under 1 s: a click makes no request.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys

CLICK = """async (step) => {
  const chip = document.querySelector(`#output .chip[data-step='${step}']`);
  const start = performance.now();
  chip.click();
  const handler = performance.now() - start;
  await new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve)));
  return [handler, performance.now() - start, Number(document.body.dataset.step)];
}"""


def builtin_workspace():
    """The generation workspace of the built-in model, and whether its weights are the shipped ones."""
    from captum_transformers.errors import InputError
    from captum_transformers.explorer.pages.generation.sources import builtin_generation_workspace
    from captum_transformers.explorer.pages.generation.workspace import GenerationWorkspace
    from captum_transformers.tasks.recall.model import build_recall_model, recall_tokenizer
    from captum_transformers.tasks.recall.task import recall_examples

    try:
        return builtin_generation_workspace(), True
    except InputError:  # weights not shipped yet: the same architecture, random weights
        import torch

        torch.manual_seed(0)
        samples = [example.prompt for example in recall_examples(6, seed=0, split="test")]
        return GenerationWorkspace(build_recall_model().eval(), recall_tokenizer(), name="recall Llama (random)",
                                   samples=samples), False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clicks", type=int, default=40, help="clicks measured (at least 20)")
    parser.add_argument("--method", default="attn-lrp")
    args = parser.parse_args(argv)
    if args.clicks < 20:
        parser.error("--clicks: measure at least 20 clicks")
    from playwright.sync_api import sync_playwright

    from captum_transformers.explorer.server import start

    chromium = os.environ.get("CAPTUM_EXPLORER_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("no Chromium binary (apt-get install -y chromium, or set CAPTUM_EXPLORER_CHROMIUM)", file=sys.stderr)
        return 2
    workspace, shipped = builtin_workspace()
    running = start(workspace, port=0, blocking=False, quiet=True)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            errors = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(running.url)
            page.wait_for_selector("body[data-ready=yes]", timeout=60_000)
            page.select_option("#method", args.method)
            page.fill("#max-new-tokens", str(workspace.max_new_tokens))
            page.click("#generate")
            page.wait_for_selector("body[data-generated] #output .chip", timeout=120_000)
            steps = page.locator("#output .chip").count()
            prompt_tokens = page.locator("#prompt-view .token").count()
            handler, painted = [], []
            for click in range(args.clicks):
                step = click % steps
                took_handler, took_painted, shown = page.evaluate(CLICK, step)
                if shown != step:
                    raise RuntimeError(f"clicked output token {step} but the page shows {shown}")
                handler.append(took_handler)
                painted.append(took_painted)
            browser.close()
    finally:
        running.stop()
    if errors:
        print("page errors:", errors, file=sys.stderr)
        return 1
    print(f"model: {workspace.name} ({'shipped' if shipped else 'random'} weights); method {args.method}; "
          f"{steps} output x {prompt_tokens} prompt tokens; {args.clicks} clicks")
    for name, values in (("handler (recoloured)", handler), ("painted (next frame)", painted)):
        print(f"{name:22s} median {statistics.median(values):6.1f} ms   worst {max(values):6.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
