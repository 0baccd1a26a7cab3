"""AttnLRP on Qwen3-MoE against LXT's AttnLRP (its Qwen3-MoE patch map) on identical weights.

Tiny random Qwen3-MoE causal LMs (2 layers, width 32, 4 or 8 experts, top-2, ``norm_topk_prob``
on and off, a dense-MLP layer in some cases, float64 and float32, three seeds) explain the
logit of the predicted next token at the last position. LXT's relevance is read its way: the
input embeddings times their gradient under ``lxt.efficient.monkey_patch``, summed over the
features; the package's is ``AttnLRP(model).attribute(ids, target=..., return_tokens=True)``
(the hidden states entering the first layer, the same tensor for Qwen3-MoE), once per experts
kernel of transformers (``eager``, ``batched_mm``, and ``grouped_mm`` in float32; LXT's patch
runs its own loop over the experts whichever the model names). The table gives, per case, the
largest absolute difference over the tokens, that difference relative to the largest
|relevance| of the case, the largest per-token relative difference, and both relevance sums.

Cases marked ``*`` remove the float32 round trips of transformers' Qwen3-MoE (RMSNorm, the
router's softmax, eager attention's softmax) on both sides, so that what is left is the rules'
own difference (LXT's identity rule divides by ``x + 1e-10``) rather than the float32 rounding of
LXT's norm and attention backward.

The two sides may run in two virtual environments (LXT pins its own transformers version; the
package needs transformers 5): the weights, config and token ids are written to a folder by
``make``, each side reads them and writes its relevance, ``compare`` prints the table. LXT's
Qwen3-MoE map needs transformers 5 (it patches the fused ``Qwen3MoeExperts`` class); 5.9 and
5.24 lay the weights out alike (experts fused in 3-D ``gate_up_proj`` / ``down_proj``), so the
state dict loads strictly on both sides. A pip-installed LXT has no git checkout to read its
commit from: set ``LXT_COMMIT`` for the table's header.

LXT itself is not a dependency of the package nor of its tests; install it from its source::

    # an environment for LXT (its README pins the transformers version it was tested with)
    python3 -m venv /tmp/lxt_venv
    /tmp/lxt_venv/bin/pip install torch transformers==5.9.0 accelerate zennit tabulate
    git clone https://github.com/rachtibat/LRP-eXplains-Transformers /tmp/lxt_src   # or git archive
    /tmp/lxt_venv/bin/pip install --no-deps /tmp/lxt_src

    # everything in one go from the package's environment (LXT's side run in its environment)
    .venv/bin/python benchmarks/lxt_moe_parity.py all --dir /tmp/lxt_moe --lxt-python /tmp/lxt_venv/bin/python

    # or step by step
    .venv/bin/python benchmarks/lxt_moe_parity.py make --dir /tmp/lxt_moe
    /tmp/lxt_venv/bin/python benchmarks/lxt_moe_parity.py lxt --dir /tmp/lxt_moe
    .venv/bin/python benchmarks/lxt_moe_parity.py ours --dir /tmp/lxt_moe
    .venv/bin/python benchmarks/lxt_moe_parity.py compare --dir /tmp/lxt_moe

``lxt`` also runs in the package's environment when LXT's source is importable there
(``PYTHONPATH=/tmp/lxt_src``), which compares the two on the package's transformers version.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# (seed, experts, top-k, norm_topk_prob, dense-MLP layers, dtype, float32 casts removed)
CASES: List[dict] = []
for _dtype, _exact in (("float64", False), ("float32", False), ("float64", True)):
    for _seed in (0, 1, 2):
        for _experts, _norm in ((4, True), (4, False), (8, True), (8, False)):
            CASES.append(dict(seed=_seed, experts=_experts, top_k=2, norm_topk_prob=_norm,
                              mlp_only_layers=[1] if _seed == 2 else [], dtype=_dtype, exact=_exact))
# The package's side runs each case with each of transformers' experts kernels (LXT's patch map
# replaces the experts' forward by its own loop, whichever kernel the model names).
KERNELS = ("eager", "batched_mm", "grouped_mm")
TOKENS = 7
VOCAB = 64


def group(case: dict) -> str:
    return case["dtype"] + (" without float32 casts" if case.get("exact") else "")


def case_name(case: dict) -> str:
    dense = "+dense" if case["mlp_only_layers"] else ""
    exact = "*" if case.get("exact") else ""
    return (f"{case['dtype']}{exact} seed{case['seed']} E{case['experts']} top{case['top_k']} "
            f"norm={'on' if case['norm_topk_prob'] else 'off'}{dense}")


def config_kwargs(case: dict) -> dict:
    """The Qwen3-MoE config of a case, as keyword arguments both transformers 4 and 5 accept."""
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                num_experts=case["experts"], num_experts_per_tok=case["top_k"],
                norm_topk_prob=case["norm_topk_prob"], decoder_sparse_step=1,
                mlp_only_layers=list(case["mlp_only_layers"]), max_position_embeddings=64,
                rms_norm_eps=1e-6, tie_word_embeddings=False, attention_dropout=0.0,
                output_router_logits=False, use_cache=False)


def build(case: dict, attention: str = "eager"):
    """The case's model with transformers' initialisation (weights are loaded over it)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**config_kwargs(case))
    try:
        model = Qwen3MoeForCausalLM._from_config(config, attn_implementation=attention,
                                                 experts_implementation="eager")
    except (TypeError, ValueError):  # transformers without selectable experts kernels
        model = Qwen3MoeForCausalLM._from_config(config, attn_implementation=attention)
    return model.to(getattr(torch, case["dtype"])).eval()


def _router_forward_in_own_dtype(self, hidden_states):
    """transformers' Qwen3-MoE router with its softmax in the input's dtype (not float32)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    router_probs = torch.softmax(router_logits, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        router_top_value = router_top_value / router_top_value.sum(dim=-1, keepdim=True)
    return router_logits, router_top_value, router_indices


def _rms_in_own_dtype(self, hidden_states):
    """RMSNorm without its float32 round trip (the package applies its own norm rule to it)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _rms_identity_in_own_dtype(self, hidden_states):
    """The norm rule of AttnLRP (the scale a constant of the backward pass), in the input's dtype:
    what LXT's patched RMSNorm computes, without its float32 round trip."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon).detach())


OWN_DTYPE_ATTENTION = "eager_in_own_dtype"


def eager_attention_in_own_dtype(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager attention with its softmax in the query's dtype (not float32), for the
    ``exact`` cases of LXT's side (the package's own attention kernel computes in float64 there);
    registered before LXT's patch, which then wraps it as it wraps every attention function."""
    groups = module.num_key_value_groups
    key = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    value = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is None:  # a registered function gets no mask for an unpadded batch: causal
        rows, columns = scores.shape[-2:]
        allowed = torch.ones(rows, columns, dtype=torch.bool, device=scores.device).tril(columns - rows)
        scores = scores.masked_fill(~allowed, float("-inf"))
    else:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def remove_float32_casts(model, lxt_side: bool) -> None:
    """Cases marked ``exact``: the router's softmax and the RMSNorms in the model's dtype on both
    sides (instance classes swapped; the same forward values), so that the comparison is not
    limited by the float32 rounding of the norms' backward in LXT's patch. (LXT's side also runs
    :func:`eager_attention_in_own_dtype`.)"""
    norm = _rms_identity_in_own_dtype if lxt_side else _rms_in_own_dtype
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            module.__class__ = type(f"Exact{name}", (type(module),), {"forward": norm})
        elif name.endswith("TopKRouter"):
            module.__class__ = type(f"Exact{name}", (type(module),), {"forward": _router_forward_in_own_dtype})


# --------------------------------------------------------------------------- make

def make(folder: str) -> None:
    """Random weights (scaled so that every path carries relevance), token ids and targets."""
    os.makedirs(folder, exist_ok=True)
    for index, case in enumerate(CASES):
        model = build(case)
        generator = torch.Generator().manual_seed(1000 + case["seed"])
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if parameter.dim() == 1:  # norm weights around 1
                    values = 1 + 0.2 * torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
                else:  # 1 / sqrt(fan in); the router twice as sharp
                    fan_in = parameter.shape[-1]
                    scale = (2.0 if name.endswith("gate.weight") else 1.0) / fan_in ** 0.5
                    values = scale * torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
                parameter.copy_(values.to(parameter.dtype))
        ids = torch.randint(0, VOCAB, (1, TOKENS), generator=generator)
        with torch.no_grad():
            target = int(model(ids).logits[0, -1].argmax())
        torch.save({"case": case, "config": config_kwargs(case), "ids": ids, "target": target,
                    "state_dict": {k: v.clone() for k, v in model.state_dict().items()}},
                   os.path.join(folder, f"case{index:02d}.pt"))
    print(f"{len(CASES)} cases written to {folder}")


def _cases(folder: str) -> List[str]:
    return sorted(f for f in os.listdir(folder) if f.startswith("case") and f.endswith(".pt"))


def _load(path: str, lxt_side: bool = False):
    saved = torch.load(path, weights_only=True)
    exact = saved["case"].get("exact")
    model = build(saved["case"], OWN_DTYPE_ATTENTION if exact and lxt_side else "eager")
    model.load_state_dict(saved["state_dict"], strict=True)
    if exact:
        remove_float32_casts(model, lxt_side)
    return saved, model


# --------------------------------------------------------------------------- LXT's side

def _lxt_commit() -> str:
    import lxt

    source = os.path.dirname(os.path.dirname(os.path.abspath(lxt.__file__)))
    try:
        return subprocess.run(["git", "-C", source, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:
        return os.environ.get("LXT_COMMIT", "unknown (set LXT_COMMIT)")


def run_lxt(folder: str) -> None:
    import warnings

    import transformers
    from transformers import AttentionInterface
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    AttentionInterface.register(OWN_DTYPE_ATTENTION, eager_attention_in_own_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from lxt.efficient import monkey_patch

        monkey_patch(modeling_qwen3_moe)  # LXT's default map for Qwen3-MoE (its AttnLRP)
    meta = {"transformers": str(transformers.__version__), "torch": str(torch.__version__), "lxt_commit": _lxt_commit()}
    for name in _cases(folder):
        saved, model = _load(os.path.join(folder, name), lxt_side=True)
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        embeddings = model.get_input_embeddings()(saved["ids"]).detach().requires_grad_()
        logits = model(inputs_embeds=embeddings).logits
        logit = logits[0, -1, saved["target"]]
        logit.backward()
        relevance = (embeddings * embeddings.grad).sum(-1)[0].detach()
        torch.save({"relevance": relevance, "logit": float(logit.detach()), **meta},
                   os.path.join(folder, "lxt_" + name))
    print(f"LXT: {len(_cases(folder))} cases, transformers {meta['transformers']}, LXT {meta['lxt_commit']}")


# --------------------------------------------------------------------------- the package's side

def run_ours(folder: str) -> None:
    import transformers

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from captum_transformers import AttnLRP

    for name in _cases(folder):
        saved, model = _load(os.path.join(folder, name))
        target = torch.tensor([saved["target"]])
        relevance, deltas = {}, {}
        for kernel in KERNELS:
            if kernel == "grouped_mm" and model.dtype == torch.float64:
                continue  # transformers' grouped_mm takes no float64
            model.set_experts_implementation(kernel)
            result, delta = AttnLRP(model).attribute(saved["ids"], target=target, return_tokens=True,
                                                     return_convergence_delta=True)
            relevance[kernel], deltas[kernel] = result[0].detach(), float(delta[0])
        model.set_experts_implementation("eager")
        with torch.no_grad():
            logit = float(model(saved["ids"]).logits[0, -1, saved["target"]])
        torch.save({"relevance": relevance, "logit": logit, "delta": deltas,
                    "transformers": str(transformers.__version__), "torch": str(torch.__version__)},
                   os.path.join(folder, "ours_" + name))
    print(f"package: {len(_cases(folder))} cases, transformers {transformers.__version__}")


# --------------------------------------------------------------------------- comparison

def compare(folder: str) -> float:
    rows, worst = [], {}
    for name in _cases(folder):
        case = torch.load(os.path.join(folder, name), weights_only=True)["case"]
        lxt = torch.load(os.path.join(folder, "lxt_" + name), weights_only=True)
        ours = torch.load(os.path.join(folder, "ours_" + name), weights_only=True)
        b = lxt["relevance"].double()
        scale = b.abs().max()
        row = dict(case=case_name(case), group=group(case), sum_lxt=float(b.sum()), logit=lxt["logit"],
                   logit_diff=abs(lxt["logit"] - ours["logit"]), kernels={})
        for kernel, relevance in ours["relevance"].items():
            diff = (relevance.double() - b).abs()
            stats = dict(abs=float(diff.max()), rel_max=float(diff.max() / scale),
                         rel_token=float((diff / b.abs().clamp_min(1e-300)).max()),
                         sum=float(relevance.double().sum()))
            row["kernels"][kernel] = stats
            for key in ("abs", "rel_max", "rel_token"):
                slot = worst.setdefault(row["group"], {}).setdefault(key, (0.0, ""))
                if stats[key] > slot[0]:
                    worst[row["group"]][key] = (stats[key], f"{row['case']}, {kernel}")
        rows.append(row)
    print(f"{'case (* = float32 casts removed)':40s} {'eager |d|':>9s} {'eager rel':>9s} {'tok rel':>8s} "
          f"{'bmm rel':>8s} {'gmm rel':>8s} {'sum ours':>9s} {'sum LXT':>9s} {'logit':>8s} {'logit d':>7s}")
    for r in rows:
        k = r["kernels"]
        gmm = f"{k['grouped_mm']['rel_max']:8.1e}" if "grouped_mm" in k else f"{'-':>8s}"
        print(f"{r['case']:40s} {k['eager']['abs']:9.1e} {k['eager']['rel_max']:9.1e} {k['eager']['rel_token']:8.1e} "
              f"{k['batched_mm']['rel_max']:8.1e} {gmm} {k['eager']['sum']:9.5f} {r['sum_lxt']:9.5f} "
              f"{r['logit']:8.4f} {r['logit_diff']:7.0e}")
    first = torch.load(os.path.join(folder, "lxt_" + _cases(folder)[0]), weights_only=True)
    mine = torch.load(os.path.join(folder, "ours_" + _cases(folder)[0]), weights_only=True)
    print(f"\nLXT {first['lxt_commit']} with transformers {first['transformers']} (torch {first['torch']}); "
          f"package with transformers {mine['transformers']} (torch {mine['torch']})")
    print("rel: max |difference| over the tokens / max |LXT relevance|; tok rel: max over the tokens of "
          "|difference| / |LXT relevance|; bmm, gmm: the package with the batched_mm, grouped_mm experts kernels")
    labels = {"abs": "max |difference|", "rel_max": "max |difference| / max |R|",
              "rel_token": "max per-token relative difference"}
    for name, entries in worst.items():
        for key, (value, where) in entries.items():
            print(f"worst, {name}: {labels[key]} = {value:.2e} ({where})")
    with open(os.path.join(folder, "summary.json"), "w") as handle:
        json.dump({"rows": rows, "worst": worst, "lxt_commit": first["lxt_commit"],
                   "lxt_transformers": first["transformers"], "package_transformers": mine["transformers"]},
                  handle, indent=1)
    return max(value for entries in worst.values() for value, _ in entries.values())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("step", choices=("make", "lxt", "ours", "compare", "all"))
    parser.add_argument("--dir", default="/tmp/lxt_moe")
    parser.add_argument("--lxt-python", default=sys.executable,
                        help="the interpreter of LXT's environment (step 'all')")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.step in ("make", "all"):
        make(args.dir)
    if args.step == "lxt":
        run_lxt(args.dir)
    if args.step == "all":
        subprocess.run([args.lxt_python, os.path.abspath(__file__), "lxt", "--dir", args.dir], check=True)
    if args.step in ("ours", "all"):
        run_ours(args.dir)
    if args.step in ("compare", "all"):
        compare(args.dir)


if __name__ == "__main__":
    main()
