"""``captum-transformers explore``: a local web page to explore explanations of a batch.

With no arguments it opens the built-in DigitCanvas ViT on 48 test canvases. ``--task``
opens a benchmark task's model and test examples; ``--model`` takes what ``explain`` takes
(with ``--image`` / ``--text`` inputs). It listens on 127.0.0.1
only; ``--host`` another address needs ``--allow-remote`` and prints a warning. The printed
URL carries the session token the page needs. ``--port`` is 0 to 65535 (0: any free port);
``--device`` puts the model on cpu, cuda, cuda:N or mps. Each is checked, with ``--results``,
before any model is loaded: a mistake is one line and exit status 2.

``--prompt TEXT`` (repeatable) or ``--generation`` opens the generation page instead: a
causal LM (the built-in recall Llama, or ``--model`` a causal-LM folder; a ``--model`` folder
whose config names a causal LM opens it too) generates greedily from a prompt and each
generated token is explained (``explorer/pages/generation/app.py``).

``--store DIR`` opens the store page instead: the rows of a corpus job's store (written by
``captum-transformers attribute``) paged, searched and sorted, each row's map drawn when clicked;
no model is loaded (``explorer/pages/store/app.py``).
"""
from __future__ import annotations

from .device import ACCEPTED, checked_device


def add_parser(subparsers) -> None:
    from ..tasks.runner import TASKS

    parser = subparsers.add_parser("explore", help="a local web page: gallery, methods x examples, curves",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="as for explain (default: the built-in DigitCanvas ViT)")
    parser.add_argument("--arch", help="timm architecture of a state-dict checkpoint")
    parser.add_argument("--random-init", action="store_true", help="timm: random weights instead of pretrained")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="read a --model checkpoint file as a full pickle (a whole nn.Module saved with "
                             "torch.save(model)). The file then runs as code: unpickling executes whatever it holds, "
                             "with your permissions. Only for a file you trust as a program; by default a checkpoint "
                             "is read with torch.load(weights_only=True), tensors only")
    parser.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    parser.add_argument("--text", action="append", default=[], help="text to classify (repeatable)")
    parser.add_argument("--task", choices=TASKS, help="a benchmark task's model and test examples (digits: the "
                                                      "default; digits-two; movies: needs the cached fine-tuned model)")
    parser.add_argument("--cache-dir", help="movies: where the data and fine-tuned model are cached")
    parser.add_argument("--samples", type=int, default=48, help="built-in model or task: number of test examples")
    parser.add_argument("--prompt", action="append", default=[],
                        help="generation page: a prompt to start with (repeatable; offered as samples)")
    parser.add_argument("--generation", action="store_true",
                        help="generation page on the built-in recall Llama (or --model, a causal-LM folder)")
    parser.add_argument("--results", help="a benchmark's results.json: its curves are shown beside the maps")
    parser.add_argument("--store", metavar="DIR", help="store page: browse a corpus store written by "
                                                       "`captum-transformers attribute` (no model is loaded)")
    parser.add_argument("--port", type=int, default=8765, help="port, 0 to 65535 (default: %(default)s; 0: any free "
                                                                "port, the URL printed says which)")
    parser.add_argument("--device", default="cpu", help=f"where the model runs: {ACCEPTED} (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--allow-remote", action="store_true",
                        help="allow --host other than loopback (the session token is then the only protection)")
    parser.add_argument("--allowed-host", action="append", default=[],
                        help="another name the Host header may carry (a proxy's or DNS name; repeatable)")
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..explorer.loading import LoadingWorkspace
    from ..explorer.server import check_host, check_port, require_explorer_extra, start
    from ..explorer.pages.classifier.sources import loaded_workspace

    require_explorer_extra()
    check_port(args.port)  # these before any model is loaded
    check_host(args.host, args.allow_remote)
    device = checked_device(args.device)
    from ..explorer.pages.classifier.benchmark import benchmark_curves

    if args.store is not None:
        return _store_page(args)
    if _generation_page(args):
        from ..explorer.pages.generation.sources import LoadingGenerationWorkspace, loaded_generation_workspace

        page = LoadingGenerationWorkspace(lambda: loaded_generation_workspace(args.model, args.prompt, device))
        start(page, host=args.host, port=args.port, blocking=True, allow_remote=args.allow_remote,
              extra_hosts=args.allowed_host)
        return 0
    benchmark = benchmark_curves(args.results) if args.results else None
    # the server listens (and prints its URL) while the model loads; a load error stops it and
    # is reported like any other (one line, exit status 2)
    workspace = LoadingWorkspace(lambda: loaded_workspace(args.model, args.arch, args.random_init, args.image,
                                                          args.text, args.samples, args.task, args.cache_dir,
                                                          device, trust_pickle=args.trust_pickle))
    start(workspace, host=args.host, port=args.port, blocking=True, benchmark=benchmark,
          allow_remote=args.allow_remote, extra_hosts=args.allowed_host)
    return 0


def _store_page(args) -> int:
    """``explore --store DIR``: the store page; any model or input option beside it is refused."""
    from ..errors import InputError
    from ..explorer.pages.store.index import StoreIndex
    from ..explorer.server import start

    mixed = [flag for flag, given in (("--model", args.model), ("--text", args.text), ("--image", args.image),
                                      ("--task", args.task), ("--prompt", args.prompt),
                                      ("--generation", args.generation), ("--results", args.results),
                                      ("--arch", args.arch)) if given]
    if mixed:
        raise InputError(f"--store opens a corpus store, which takes none of {', '.join(mixed)} (the store names its "
                         "model and method); drop them, or drop --store.")
    start(StoreIndex(args.store), host=args.host, port=args.port, blocking=True, allow_remote=args.allow_remote,
          extra_hosts=args.allowed_host)
    return 0


def _generation_page(args) -> bool:
    """Whether the arguments ask for the generation page; a mix with the classifier's inputs is
    refused (one line, exit status 2) before any model is loaded."""
    from ..errors import InputError
    from ..explorer.pages.generation.sources import causal_lm_folder

    asked = bool(args.prompt) or args.generation
    causal = causal_lm_folder(args.model) and not args.image and not args.text
    if not (asked or causal):
        return False
    mixed = [flag for flag, given in (("--text", args.text), ("--image", args.image), ("--task", args.task),
                                      ("--results", args.results), ("--arch", args.arch)) if given]
    if mixed:
        raise InputError(f"--prompt/--generation open the generation page, which takes none of {', '.join(mixed)}; "
                         "give either a prompt (with --model a causal-LM folder, or none for the built-in recall "
                         "Llama) or the classifier's inputs.")
    return True
