"""inseq's ``input_x_gradient`` for ``generation_cost.py`` (operation ``e``), run in a scratch venv.

inseq pins its own transformers, so it runs in a venv outside the repository (``python3 -m venv
/tmp/inseq_venv && /tmp/inseq_venv/bin/pip install inseq``) and this file imports nothing of the
package. It loads the weights, config and tokenizer that ``generation_cost.py`` saved with
``save_pretrained`` (``MODEL_DIR``, with ``bench_tokens.json``: the prompt and target ids), forces
the target with ``generated_texts`` (prompt + target: inseq explains each target token from its
prefix), and answers one request per line on stdin with one JSON line on stdout:

* at start: versions and the shape of its attribution (after one warm-up call);
* ``run``: the CPU seconds (``time.process_time``) of one ``attribute`` call;
* ``peak``: the peak memory of one call (``peak_memory.peak_bytes``: glibc returning freed
  buffers at once, warm-up call, peak RSS above what was live before).

Example::

    /tmp/inseq_venv/bin/python benchmarks/generation_cost_inseq.py /tmp/gen_bench_model --threads 1
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--memory", action="store_true", help="glibc returns freed buffers (memory runs)")
    args = parser.parse_args()
    # Answers go to the original stdout; anything a library prints goes to stderr instead.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch

    torch.set_num_threads(args.threads)
    from peak_memory import _reusing_malloc, _tight_malloc, peak_bytes

    from importlib.metadata import version

    import inseq
    import transformers

    with open(os.path.join(args.model_dir, "bench_tokens.json")) as tokens:
        spec = json.load(tokens)
    prompt = " ".join(f"t{i}" for i in spec["prompt"])
    full = " ".join(f"t{i}" for i in spec["prompt"] + spec["target"])
    model = inseq.load_model(args.model_dir, "input_x_gradient",
                             model_kwargs={"attn_implementation": spec["attn"], "dtype": torch.float32})
    model.model.eval()

    def op():
        return model.attribute(input_texts=prompt, generated_texts=full, show_progress=False, pretty_progress=False)

    (_tight_malloc if args.memory else _reusing_malloc)()
    out = op()
    attribution = out.sequence_attributions[0]
    forced = [token.token for token in attribution.target][-len(spec["target"]):]
    if forced != [f"t{i}" for i in spec["target"]]:
        raise RuntimeError(f"inseq explained {forced[:5]}..., not the given target")
    shape = tuple(attribution.target_attributions.shape) if attribution.target_attributions is not None else None
    answers.write(json.dumps({"inseq": version("inseq"),
                              "transformers": transformers.__version__, "torch": torch.__version__,
                              "shape": shape}) + "\n")
    answers.flush()
    for line in sys.stdin:
        request = line.strip()
        if request == "run":
            started = time.process_time()
            op()
            answers.write(json.dumps({"cpu": time.process_time() - started}) + "\n")
        elif request == "peak":
            peak, exact = peak_bytes(op)
            answers.write(json.dumps({"peak": peak, "exact": exact}) + "\n")
        else:
            answers.write(json.dumps({"error": f"unknown request {request!r}"}) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
