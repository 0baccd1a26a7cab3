"""``captum-transformers attribute``: explain a whole corpus into a resumable Parquet store.

``--data digits:N`` explains N built-in DigitCanvas test canvases with the built-in model (the
default); ``--data FILE`` reads a column (``--column``, default ``text``) of a Parquet file or
folder, or a JSON-lines file, prepared for ``--model`` as ``explain`` prepares ``--text``.
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
                        help="digits:N (built-in canvases), or a .parquet / .jsonl file or a folder of .parquet "
                             "files (default: %(default)s)")
    parser.add_argument("--column", default="text", help="the column of --data to explain (default: %(default)s)")
    parser.add_argument("--method", default="generic-attention", choices=KNOWN_METHOD_NAMES,
                        help="the method (default: %(default)s)")
    parser.add_argument("--target", default="predicted", choices=("predicted", "label"),
                        help="the class explained: the prediction, or the data's label (digits only)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--shard-rows", type=int, default=256, help="rows per Parquet shard (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help=f"where the model runs: {ACCEPTED} (default: %(default)s)")
    parser.add_argument("--out", default="captum_transformers_corpus", help="the store's folder (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..corpus import digit_canvas_source, explain_dataset, table_source
    from ..model_loading import load_model

    device = checked_device(args.device)
    loaded = load_model(args.model)
    digits = re.fullmatch(r"digits:(\d+)", args.data)
    if digits:
        if args.model is not None:
            raise InputError("--data digits:N explains the built-in DigitCanvas model; drop --model, or give a "
                             "data file for your model.")
        source = digit_canvas_source(int(digits.group(1)))
    else:
        source = table_source(args.data, loaded.prepare, args.column)
    done = explain_dataset(loaded.model.to(device), source, args.method, args.out, batch_size=args.batch_size,
                           shard_rows=args.shard_rows, target=args.target, progress=not args.no_progress)
    if done.rank == 0:
        print(f"{args.out}: {source.description}, {args.method}; this process computed {done.shards_computed} "
              f"shard(s) ({done.rows_computed} rows, {done.seconds:.1f} s), found {done.shards_skipped} finished"
              + (f", recomputed {done.recomputed} unfinished or damaged" if done.recomputed else ""))
    return 0
