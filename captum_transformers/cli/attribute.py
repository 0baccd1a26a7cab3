"""``captum-transformers attribute``: explain a whole corpus into a resumable Parquet store.

``--data digits:N`` explains N built-in DigitCanvas test canvases with the built-in model (the
default), ``--data motifs:N`` N BA-2Motifs test graphs with the built-in motif transformer;
``--data FILE`` reads a column (``--column``, default ``text``) of a Parquet file or folder, a
JSON-lines file, or a folder written by ``datasets``' ``save_to_disk`` (texts, or encoded
images: ``datasets``' Image feature), or the image files of a folder, prepared for ``--model``
as ``explain`` prepares ``--text`` and ``--image``.

Generation: ``--data recall:N`` lets the built-in recall Llama answer N associative-recall
prompts; ``--generate N`` with ``--data FILE`` (a column of prompts, default ``prompt``) and
``--model`` (a language model folder) lets that model answer them, N new tokens at most. Each
answer token is explained over the prompt and the tokens before it (``--score``).
Under ``torchrun --nproc-per-node K`` each process writes every K-th shard. Running the same
command again resumes; another method or model into the same ``--out`` is refused. The
store's layout and schema: ``captum_transformers.corpus.store``.
"""
from __future__ import annotations

import re

from ..errors import InputError
from ..methods.catalog import KNOWN_METHOD_NAMES
from .device import ACCEPTED, checked_device


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("attribute", help="explain every row of a dataset into a Parquet store "
                                                     "(resumable, sharded over torchrun processes)",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF model directory or hub id, timm name or checkpoint (default: the "
                                        "built-in DigitCanvas ViT)")
    parser.add_argument("--data", default="digits:1000",
                        help="digits:N (built-in canvases), motifs:N (built-in graphs), recall:N (built-in recall "
                             "prompts, a generation job), a .parquet / .jsonl file, a folder of .parquet files or of "
                             "images, or a datasets save_to_disk folder (default: %(default)s)")
    parser.add_argument("--column", help="the column of --data to explain (default: text; prompt with --generate)")
    parser.add_argument("--generate", type=int, metavar="N",
                        help="a generation job: the --model language model answers each prompt of --data with at "
                             "most N new tokens (--data recall:N: the built-in recall Llama, default 3)")
    parser.add_argument("--score", default="logit", choices=("logit", "log_prob", "prob"),
                        help="generation: the explained score of each output token (default: %(default)s)")
    parser.add_argument("--method", default="generic-attention", choices=KNOWN_METHOD_NAMES,
                        help="the method (default: %(default)s)")
    parser.add_argument("--target", default="predicted", choices=("predicted", "label"),
                        help="the class explained: the prediction, or the data's label (built-in digits and motifs)")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per method call (default: %(default)s)")
    parser.add_argument("--shard-rows", type=int, default=256, help="rows per Parquet shard (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help=f"where the model runs: {ACCEPTED} (default: %(default)s)")
    parser.add_argument("--out", default="captum_transformers_corpus", help="the store's folder (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..corpus import digit_canvas_source, explain_dataset, motif_graph_source, table_source

    device = checked_device(args.device)
    if re.fullmatch(r"recall:\d+", args.data) or args.generate is not None:
        return _run_generation(args, device)
    if args.score != "logit":
        raise InputError(f"--score {args.score} is a generation job's option; add --generate N (or --data recall:N) "
                         "or drop it.")
    from ..model_loading import load_model

    builtin = re.fullmatch(r"(digits|motifs):(\d+)", args.data)
    if builtin and args.model is not None:
        raise InputError(f"--data {builtin.group(1)}:N explains the built-in {builtin.group(1)} model; drop --model, or "
                         "give a data file for your model.")
    if builtin and builtin.group(1) == "motifs":
        from ..tasks.motifs.model import load_motif_model

        model, source = load_motif_model(), motif_graph_source(int(builtin.group(2)))
    else:
        loaded = load_model(args.model)
        model = loaded.model
        if builtin:
            source = digit_canvas_source(int(builtin.group(2)))
        else:
            source = table_source(args.data, loaded.prepare, args.column or "text")
            if source.value_kind and source.value_kind != loaded.modality:
                article = "an" if loaded.modality[0] in "aeiou" else "a"
                raise InputError(f"--data {args.data!r} holds {source.value_kind}s but {loaded.name} is {article} "
                                 f"{loaded.modality} model; give {loaded.modality} data (--column chooses the "
                                 "column), or the model for this data.")
    done = explain_dataset(model.to(device), source, args.method, args.out, batch_size=args.batch_size,
                           shard_rows=args.shard_rows, target=args.target, progress=not args.no_progress)
    return _report(args, source, done)


def _run_generation(args, device) -> int:
    from ..corpus import explain_generations, prompt_table_source, recall_prompt_source
    from .generation_explain import load_generative_model

    if args.target != "predicted":
        raise InputError("--target label: a generation job explains the model's own answers; drop --target.")
    if args.generate is not None and args.generate < 1:
        raise InputError(f"--generate {args.generate}: expected a positive number of new tokens, e.g. --generate 20.")
    recall = re.fullmatch(r"recall:(\d+)", args.data)
    if recall and args.model is not None:
        raise InputError("--data recall:N is the built-in recall Llama's task; drop --model, or give a file of "
                         "prompts for your model.")
    if not recall and args.model is None:
        raise InputError(f"--generate with --data {args.data!r} needs --model, a language model folder (or use "
                         "--data recall:N for the built-in recall Llama).")
    model, tokenizer, _, default_new = load_generative_model(args.model)
    source = recall_prompt_source(int(recall.group(1))) if recall else prompt_table_source(args.data,
                                                                                            args.column or "prompt")
    done = explain_generations(model.to(device), tokenizer, source, args.method, args.out,
                               max_new_tokens=args.generate or default_new, score=args.score,
                               batch_size=args.batch_size, shard_rows=args.shard_rows, progress=not args.no_progress)
    return _report(args, source, done)


def _report(args, source, done) -> int:
    if done.rank == 0:
        print(f"{args.out}: {source.description}, {args.method}; this process computed {done.shards_computed} "
              f"shard(s) ({done.rows_computed} rows, {done.seconds:.1f} s), found {done.shards_skipped} finished"
              + (f", recomputed {done.recomputed} unfinished or damaged" if done.recomputed else ""))
    return 0
