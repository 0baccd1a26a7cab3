"""The cost of explaining every generated token: GenerationAttribution against Captum's LLM
wrapper, inseq and the plain passes it is built from.

Model: a random ``LlamaForCausalLM`` from a config (8 layers, hidden 256, 8 query / 4 key-value
heads, MLP 688, vocabulary 32000, untied head, seed 0, float32, eval, eager attention). Tokens:
a prompt of 256 random ids and 32 given target ids (no generation in any timing); the tokenizer
is a WordLevel ``PreTrainedTokenizerFast`` whose token ``t<i>`` is id ``i``, so every library
sees exactly the same ids. One thread. Operations:

* ``a``: ``GenerationAttribution(AttnLRP(model), tok).attribute(prompt_ids, target=target_ids)``
  (``score="logit"``; also ``"log_prob"``): one forward pass over prompt + target, the LM head at
  the 32 explained positions only, 32 backward passes;
* ``b``: Captum's ``LLMGradientAttribution(LayerGradientXActivation(model, embeddings), tok)``
  on ``TextTokenInput``: one forward + backward over the growing prefix per target token;
* ``c``: ``LLMGradientAttribution(LayerAttnLRP(model), tok)``: the package's rules under
  Captum's per-token loop;
* ``d``: the floor: one plain forward (head at the 32 positions, ``logits_to_keep``) and 32
  ``autograd.grad`` of each step's logit to the embedding output (``retain_graph``);
* ``e``: inseq's ``input_x_gradient`` with the target forced (``generated_texts``), run by
  ``generation_cost_inseq.py`` in a scratch venv (``--inseq-python``) on the same weights and
  tokenizer (saved with ``save_pretrained`` to ``--model-dir``). That worker stays up for the
  whole run: each round asks it for one call and it reports its own CPU time, so ``e`` is
  interleaved with the others like an in-process operation.

Timing: process CPU time (``time.process_time``) of one call, ``--repeats`` interleaved rounds
(each round runs every operation once, rotated) after one warm-up round, glibc keeping freed
buffers (:func:`peak_memory._reusing_malloc`). A ratio ``a / x`` is taken within each round; the
table gives its median and worst (largest) value over the rounds. Peak memory: each operation in
a fresh interpreter (``--memory subprocess``; ``inprocess`` with ``--quick``), glibc returning
every buffer at once, peak RSS above what was live before the call (:func:`peak_memory.peak_bytes`:
warm-up call, ``/proc/self/clear_refs``, ``VmHWM - VmRSS``); weights and inputs excluded.

Measured on the 2-core development VM (other jobs running: load about 5), one thread, eager
attention, ``--repeats 5``; torch 2.14.1, transformers 5.24.0, Captum 0.9.0 in the project's venv;
inseq 0.7.1 in its own venv, where pip chose the same torch 2.14.1 and transformers 5.24.0::

    | operation                                             | CPU s, median | worst | peak memory |
    | a  GenerationAttribution(AttnLRP), logit              | 2.866 | 2.955 |  81 MiB |
    | a' GenerationAttribution(AttnLRP), log_prob           | 2.919 | 2.948 |  81 MiB |
    | b  Captum LLMGradientAttribution(LayerGradientXAct.)  | 7.769 | 8.088 | 106 MiB |
    | c  Captum LLMGradientAttribution(LayerAttnLRP)        | 7.909 | 8.100 | 101 MiB |
    | d  1 forward + T autograd.grad (floor)                | 2.841 | 2.963 |  82 MiB |
    | e  inseq input_x_gradient                             | 7.788 | 7.913 | 115 MiB |

    | ratio  | median | worst  | target  | peak memory ratio |
    | a / b  | 0.366x | 0.375x | <= 0.5x | 0.77x |
    | a / e  | 0.373x | 0.377x | <= 0.5x | 0.71x |
    | a / d  | 0.997x | 1.027x | <= 1.2x | 0.99x |
    | a' / b | 0.376x | 0.377x | <= 0.5x | 0.77x |
    | a' / e | 0.374x | 0.382x | <= 0.5x | 0.71x |
    | a' / d | 1.015x | 1.031x | <= 1.2x | 0.99x |
    | c / b  | 1.018x | 1.026x | -       | 0.95x |

``a`` costs what the floor ``d`` costs: one forward and 32 backward passes through the whole
288-token graph; ``b``, ``c`` and ``e`` run 32 forward + backward passes on the prefixes, each
with the 32000-word head at every position. The package's map agrees with Captum's loop under the
same rules (``a'`` against ``c``: at most 2.1e-08 apart, largest value 3.0e-02).

The same under SDPA (``--attn sdpa --repeats 3 --memory off``, inseq on SDPA too): a 2.831 s,
a' 2.781, b 7.409, c 7.672, d 2.715, e 7.378 (CPU s, medians); a / b 0.384x (worst 0.389x), a / e
0.384x (0.384x), a / d 1.042x (1.043x); a' / d 1.014x (1.032x). Where the time goes (eager):
in ``d`` the forward pass takes 0.08 s and each of the 32 backward passes 0.088 s; a cProfile of
one ``a`` call gives the same split (capture forward 3 %, the 32 ``autograd.grad`` calls 96 %, of
which the rules' Python backward functions are under a tenth).

Command::

    python benchmarks/generation_cost.py --repeats 5                 # 6 CPU minutes, 14 on the busy VM
    python benchmarks/generation_cost.py --attn sdpa --no-inseq      # the same under SDPA
    python benchmarks/generation_cost.py --quick                     # tiny sizes, smoke test

Scratch venv for ``e`` (outside the repository)::

    python3 -m venv /tmp/inseq_venv && /tmp/inseq_venv/bin/pip install inseq
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from peak_memory import _reusing_malloc, _tight_malloc, peak_bytes  # noqa: E402

WORKER = os.path.join(HERE, "generation_cost_inseq.py")
SPECIAL = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2; prompt and target ids are drawn above them


@dataclasses.dataclass(frozen=True)
class GenSize:
    layers: int = 8
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 688
    vocab: int = 32000
    prompt: int = 256
    target: int = 32


FULL = GenSize()
QUICK = GenSize(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64, vocab=64, prompt=12, target=4)

#: name -> what the table calls it
OPERATIONS = {
    "a_logit": "a  GenerationAttribution(AttnLRP), logit",
    "a_log_prob": "a' GenerationAttribution(AttnLRP), log_prob",
    "b_captum_gxa": "b  Captum LLMGradientAttribution(LayerGradientXActivation)",
    "c_captum_attnlrp": "c  Captum LLMGradientAttribution(LayerAttnLRP)",
    "d_floor": "d  1 forward + T autograd.grad (floor)",
    "e_inseq": "e  inseq input_x_gradient",
}
#: ratio rows: (numerator, denominator, target or None)
RATIOS = (("a_logit", "b_captum_gxa", 0.5), ("a_logit", "e_inseq", 0.5), ("a_logit", "d_floor", 1.2),
          ("a_log_prob", "b_captum_gxa", 0.5), ("a_log_prob", "e_inseq", 0.5), ("a_log_prob", "d_floor", 1.2),
          ("c_captum_attnlrp", "b_captum_gxa", None))


# --------------------------------------------------------------------------- model, tokenizer, tokens

def build_model(size: GenSize, attn: str = "eager", seed: int = 0) -> torch.nn.Module:
    """A random Llama causal LM at ``size`` (untied head, float32, eval)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
        max_position_embeddings=max(1024, size.prompt + size.target), tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation=attn)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(torch.float32).eval()


def build_tokenizer(vocab: int):
    """A WordLevel tokenizer: ``<unk> <s> </s>`` then ``t3 .. t<vocab-1>``, split on spaces, no
    special tokens added, so ``" ".join`` of the tokens encodes back to the same ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {token: i for i, token in enumerate(SPECIAL)}
    words.update({f"t{i}": i for i in range(len(SPECIAL), vocab)})
    core = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<unk>")


def make_tokens(size: GenSize, seed: int = 1) -> Tuple[List[int], List[int]]:
    """(prompt ids, target ids), random, above the special ids."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(len(SPECIAL), size.vocab, (size.prompt + size.target,), generator=generator).tolist()
    return ids[:size.prompt], ids[size.prompt:]


def as_text(ids: Sequence[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


# --------------------------------------------------------------------------- operations

def make_ops(model: torch.nn.Module, tokenizer, prompt: List[int],
             target: List[int]) -> Dict[str, Callable[[], object]]:
    """The in-process operations ``a`` .. ``d``; each returns its (T, P) token map."""
    from captum.attr import LayerGradientXActivation, LLMGradientAttribution, TextTokenInput

    from captum_transformers import AttnLRP, GenerationAttribution, LayerAttnLRP

    method = AttnLRP(model)
    by_logit = GenerationAttribution(method, tokenizer, score="logit")
    by_log_prob = GenerationAttribution(method, tokenizer, score="log_prob")
    embeddings = model.get_input_embeddings()
    captum_gxa = LLMGradientAttribution(LayerGradientXActivation(model, embeddings), tokenizer)
    captum_attnlrp = LLMGradientAttribution(LayerAttnLRP(model), tokenizer)
    text, target_tensor = as_text(prompt), torch.tensor(target)
    ids = torch.tensor([prompt + target[:-1]])
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(target) - 1)

    def captum(wrapper):
        inp = TextTokenInput(text, tokenizer)
        if inp.to_model_input()[0].tolist() != prompt:  # the tokenizer must not change the ids
            raise RuntimeError("TextTokenInput did not reproduce the prompt ids")
        return wrapper.attribute(inp, target=target_tensor).token_attr

    def floor():
        with torch.enable_grad():
            hidden = embeddings(ids).detach().requires_grad_()
            logits = model(inputs_embeds=hidden, logits_to_keep=positions).logits[0]
            rows = []
            for t, token in enumerate(target):
                (grad,) = torch.autograd.grad(logits[t, token], hidden, retain_graph=t < len(target) - 1)
                rows.append((grad * hidden.detach())[0, :len(prompt)].sum(-1))
        return torch.stack(rows)

    return {
        "a_logit": lambda: by_logit.attribute(prompt, target=target).token_attr,
        "a_log_prob": lambda: by_log_prob.attribute(prompt, target=target).token_attr,
        "b_captum_gxa": lambda: captum(captum_gxa),
        "c_captum_attnlrp": lambda: captum(captum_attnlrp),
        "d_floor": floor,
    }


class InseqWorker:
    """``generation_cost_inseq.py`` running in the scratch venv; one call per ``__call__``."""

    def __init__(self, python: str, model_dir: str, threads: int, memory: bool = False) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONPATH="")
        command = [python, WORKER, model_dir, "--threads", str(threads)] + (["--memory"] if memory else [])
        self.log = os.path.join(model_dir, "inseq_worker.log")  # a file: a full stderr pipe would block it
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                            text=True, env=env, cwd="/tmp")
        self.ready = self._answer()

    def _answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            with open(self.log) as log:
                raise RuntimeError("inseq worker stopped:\n" + log.read()[-4000:])
        return json.loads(line)

    def ask(self, request: str) -> dict:
        self.process.stdin.write(request + "\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)


def save_model(model: torch.nn.Module, tokenizer, prompt: List[int], target: List[int], model_dir: str) -> None:
    """Weights, config, tokenizer and the token ids, for the inseq worker."""
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with open(os.path.join(model_dir, "bench_tokens.json"), "w") as tokens:
        json.dump({"prompt": prompt, "target": target, "attn": model.config._attn_implementation}, tokens)


# --------------------------------------------------------------------------- timing and memory

def time_rounds(ops: Dict[str, Callable[[], object]], worker: Optional[InseqWorker],
                repeats: int) -> Dict[str, List[float]]:
    """CPU seconds of every operation per round; each round runs every one once, rotated."""
    _reusing_malloc()
    names = list(ops) + (["e_inseq"] if worker else [])

    def run(name: str) -> float:
        if name == "e_inseq":
            return worker.ask("run")["cpu"]
        gc.collect()
        started = time.process_time()
        ops[name]()
        return time.process_time() - started

    for name in names:  # warm-up round
        run(name)
    seconds: Dict[str, List[float]] = {name: [] for name in names}
    for index in range(repeats):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            seconds[name].append(run(name))
    return seconds


def _child_memory(size: GenSize, attn: str, name: str, threads: int) -> None:
    torch.set_num_threads(threads)
    model = build_model(size, attn)
    prompt, target = make_tokens(size)
    op = make_ops(model, build_tokenizer(size.vocab), prompt, target)[name]
    _tight_malloc()
    peak, exact = peak_bytes(op)
    print(json.dumps({"peak": peak, "exact": exact}))


def measure_peaks(names: Sequence[str], size: GenSize, attn: str, threads: int, mode: str,
                  ops: Dict[str, Callable[[], object]], quick: bool) -> Dict[str, Tuple[int, bool]]:
    """Peak bytes above the live memory, per operation (in a fresh interpreter unless inprocess)."""
    peaks = {}
    for name in names:
        if mode == "inprocess":
            _tight_malloc()
            peaks[name] = peak_bytes(ops[name])
            continue
        command = [sys.executable, os.path.abspath(__file__), "--_child-memory", name, "--attn", attn,
                   "--threads", str(threads)] + (["--quick"] if quick else [])
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        if done.returncode:
            raise RuntimeError(f"memory child for {name} failed:\n{done.stderr[-4000:]}")
        answer = json.loads(done.stdout.strip().splitlines()[-1])
        peaks[name] = (answer["peak"], answer["exact"])
    return peaks


# --------------------------------------------------------------------------- report

def table(seconds: Dict[str, List[float]], peaks: Dict[str, Tuple[int, bool]]) -> List[str]:
    """The printed table: one row per operation, then one per ratio."""
    def mib(name: str) -> str:
        if name not in peaks:
            return "-"
        value, exact = peaks[name]
        return f"{'' if exact else '~'}{value / 2 ** 20:.1f} MiB"

    lines = ["| operation | CPU s, median | CPU s, worst | peak memory |", "|---|---|---|---|"]
    for name, label in OPERATIONS.items():
        if name in seconds:
            median, worst = statistics.median(seconds[name]), max(seconds[name])
            lines.append(f"| {label} | {median:.3f} | {worst:.3f} | {mib(name)} |")
    lines += ["", "| ratio (within a round) | median | worst | target | peak memory ratio |", "|---|---|---|---|---|"]
    for top, bottom, target in RATIOS:
        if top not in seconds or bottom not in seconds:
            continue
        per_round = [a / b for a, b in zip(seconds[top], seconds[bottom])]
        goal = "-" if target is None else f"<= {target}x" + (" met" if max(per_round) <= target else
                                                            " median met" if statistics.median(per_round) <= target
                                                            else " MISSED")
        memory = "-"
        if top in peaks and bottom in peaks and peaks[bottom][0]:
            memory = f"{peaks[top][0] / peaks[bottom][0]:.2f}x"
        lines.append(f"| {OPERATIONS[top].split()[0]} / {OPERATIONS[bottom].split()[0]} | "
                     f"{statistics.median(per_round):.3f}x | {max(per_round):.3f}x | {goal} | {memory} |")
    return lines


def check_agreement(ops: Dict[str, Callable[[], object]], prompt: List[int], target: List[int]) -> List[str]:
    """Sanity: every map is (T, P); AttnLRP of log p agrees between the package's engine and
    Captum's per-token loop (the same relevance, two ways)."""
    maps = {name: op() for name, op in ops.items()}
    for name, value in maps.items():
        if tuple(value.shape) != (len(target), len(prompt)):
            raise RuntimeError(f"{name} returned a map of shape {tuple(value.shape)}, expected "
                               f"{(len(target), len(prompt))}")
    gap = (maps["a_log_prob"].double() - maps["c_captum_attnlrp"].double()).abs().max().item()
    scale = maps["c_captum_attnlrp"].double().abs().max().item()
    return [f"check: a' (log_prob) vs c: max |difference| {gap:.2e} (max |c| {scale:.2e})"]


def main(argv: Optional[Sequence[str]] = None) -> List[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds after one warm-up round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    parser.add_argument("--memory", default=None, choices=["subprocess", "inprocess", "off"],
                        help="peak memory per operation (default subprocess; inprocess with --quick)")
    parser.add_argument("--inseq-python", default="/tmp/inseq_venv/bin/python",
                        help="the scratch venv's python for inseq (e); skipped if missing or with --no-inseq")
    parser.add_argument("--no-inseq", action="store_true")
    parser.add_argument("--model-dir", default="/tmp/gen_bench_model")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds, no inseq (smoke test)")
    parser.add_argument("--_child-memory", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(args.threads)
        if args._child_memory:
            _child_memory(size, args.attn, args._child_memory, args.threads)
            return []
        return _run(args, size)
    finally:
        torch.set_num_threads(threads)
        _tight_malloc(False)
        gc.unfreeze()


def _run(args: argparse.Namespace, size: GenSize) -> List[str]:
    import captum
    import transformers

    repeats = 2 if args.quick else args.repeats
    memory = args.memory or ("inprocess" if args.quick else "subprocess")
    model = build_model(size, args.attn)
    tokenizer = build_tokenizer(size.vocab)
    prompt, target = make_tokens(size)
    ops = make_ops(model, tokenizer, prompt, target)
    gc.freeze()  # the many long-lived objects of transformers made each gc.collect() take 0.7 s
    lines = [f"torch {torch.__version__}, transformers {transformers.__version__}, captum {captum.__version__}; "
             f"{args.threads} thread(s); {size}; attention {args.attn}; {repeats} rounds; memory {memory}"]
    lines += check_agreement(ops, prompt, target)
    worker = memory_worker = None
    use_inseq = not (args.quick or args.no_inseq) and os.path.exists(args.inseq_python)
    if use_inseq:
        save_model(model, tokenizer, prompt, target, args.model_dir)
        worker = InseqWorker(args.inseq_python, args.model_dir, args.threads)
        lines.append(f"inseq {worker.ready['inseq']} with transformers {worker.ready['transformers']}, torch "
                     f"{worker.ready['torch']}; its map {worker.ready['shape']}")
    else:
        lines.append("inseq: not run (" + ("--quick" if args.quick else "--no-inseq" if args.no_inseq
                                           else f"{args.inseq_python} not found") + ")")
    for line in lines:
        print(line, flush=True)
    try:
        seconds = time_rounds(ops, worker, repeats)
    finally:
        if worker:
            worker.close()
    peaks = {} if memory == "off" else measure_peaks(list(ops), size, args.attn, args.threads, memory, ops, args.quick)
    if use_inseq and memory != "off":
        memory_worker = InseqWorker(args.inseq_python, args.model_dir, args.threads, memory=True)
        try:
            answer = memory_worker.ask("peak")
            peaks["e_inseq"] = (answer["peak"], answer["exact"])
        finally:
            memory_worker.close()
    rows = table(seconds, peaks)
    if args.quick:
        rows.append("(--quick: at tiny sizes the ratios measure Python overhead, not the targets)")
    for line in rows:
        print(line, flush=True)
    return lines + rows


if __name__ == "__main__":
    main()
