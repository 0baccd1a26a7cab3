"""Cost of the attention methods on multi-stream models, relative to a training-step-like pass.

Base-sized models built from configs with random weights (no hub): LXMERT (hidden 768,
9 language, 5 cross, 5 relational layers; 20 tokens, 36 regions), BART-base (6 + 6 layers,
64 source and 16 prefix tokens) and CLIP ViT-B/32 (12 + 12 layers, 16 tokens, 224x224).
For each, the median time of one ``attribute`` call over ``--repeats`` interleaved runs is
printed next to a plain forward (no gradient) and a forward plus ``autograd.grad`` of the
explained logits with respect to every parameter (what a training step costs). GenericAttention
should cost about one forward and one backward; its relevancy maps between streams are dense
(B, N_s, N_t) products, which these sizes keep small next to the model.

Usage::

    python benchmarks/multistream_methods.py                 # all three, batch 8
    python benchmarks/multistream_methods.py --models lxmert --batch 4 --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, Tuple

import torch

MODELS = ("lxmert", "bart", "clip")
METHODS = ("RawAttention", "AttentionRollout", "AttentionGradCAM", "GenericAttention")


def build(name: str, batch: int) -> Tuple[torch.nn.Module, tuple, dict, Callable[[object], torch.Tensor]]:
    """(model, inputs, forward_kwargs, logits of the output) for one model family."""
    import transformers

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    if name == "lxmert":
        config = transformers.LxmertConfig(num_qa_labels=100)
        model = transformers.LxmertForQuestionAnswering(config)
        inputs = (torch.randint(5, 1000, (batch, 20), generator=generator),
                  torch.randn(batch, 36, config.visual_feat_dim, generator=generator),
                  torch.rand(batch, 36, config.visual_pos_dim, generator=generator))
        return model.eval(), inputs, {}, lambda out: out.question_answering_score
    if name == "bart":
        model = transformers.BartForConditionalGeneration(transformers.BartConfig())
        inputs = (torch.randint(5, 1000, (batch, 64), generator=generator),
                  torch.randint(5, 1000, (batch, 16), generator=generator))
        return model.eval(), inputs, {}, lambda out: out.logits[:, -1]
    if name == "clip":
        model = transformers.CLIPModel(transformers.CLIPConfig())
        ids = torch.randint(5, 1000, (batch, 16), generator=generator)
        ids[:, -1] = model.config.text_config.eos_token_id
        inputs = (ids, torch.randn(batch, 3, 224, 224, generator=generator))
        return model.eval(), inputs, {}, lambda out: out.logits_per_image
    raise ValueError(f"unknown model {name!r}; use one of {MODELS}")


def ops(name: str, batch: int) -> Dict[str, Callable[[], object]]:
    import captum_transformers as ct

    model, inputs, kwargs, logits_of = build(name, batch)
    params = [p for p in model.parameters() if p.requires_grad]
    targets = list(range(batch)) if name == "clip" else [3] * batch

    def call(*tensors):  # BART takes its decoder prefix by keyword
        if name == "bart":
            return model(tensors[0], decoder_input_ids=tensors[1], **kwargs)
        return model(*tensors, **kwargs)

    def forward():
        with torch.no_grad():
            return call(*inputs)

    def train_step():
        logits = logits_of(call(*inputs))
        score = logits.gather(1, torch.tensor(targets)[:, None]).sum()
        return torch.autograd.grad(score, params, allow_unused=True)  # heads not on the path stay unused

    table = {"forward": forward, "train_step": train_step}
    for method in METHODS:
        explainer = getattr(ct, method)(model)
        table[method] = lambda explainer=explainer: explainer.attribute(inputs, target=targets)
    return table


def median_times(table: Dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> Dict[str, float]:
    for op in table.values():
        for _ in range(warmup):
            op()
    times: Dict[str, list] = {name: [] for name in table}
    names = list(table)
    for round_index in range(repeats):  # interleaved, rotating order: drift hits every op alike
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            start = time.perf_counter()
            table[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print("| model | op | ms | x forward | x train step |\n|---|---|---|---|---|")
    for name in args.models:
        medians = median_times(ops(name, args.batch), args.repeats)
        for op, seconds in medians.items():
            print(f"| {name} | {op} | {seconds * 1e3:.0f} | {seconds / medians['forward']:.2f} | "
                  f"{seconds / medians['train_step']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
