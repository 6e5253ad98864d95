"""The `stitchflow` command line: one verb per thing a user runs, each with --help.

    stitchflow apps                         list the app zoo and the datasets
    stitchflow ops --grep norm              the PyTorch ops stitchflow lowers (JSON with --json)
    stitchflow show gcn --fusion partial    captured IR and fusion regions (JSON with --json)
    stitchflow run gcn --dataset cora       compile, run, compare with eager, time both
    stitchflow explain gcn --fusion auto    why each pair of neighbouring ops is or is not fused
    stitchflow explore gcn --dataset cora   sweep fusion configurations, prune, evaluate, plot
    stitchflow simulate gcn --fusion partial  cycles and counters on the dataflow simulator
    stitchflow bench stitching|blocks|chains|gnn|attention|training   GPU benchmarks (on a machine with a GPU)
    stitchflow bench simulator              the dataflow simulator's speed (CPU)
    stitchflow cache [--clear plans]        what stitchflow keeps on disk between processes, and clearing it
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from typing import Sequence

import torch


def _app_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("app", help="app name (see `stitchflow apps`)")
    p.add_argument("--size", default=None, help="app size: small (tests) or default (the paper's size), or a preset")
    p.add_argument("--dataset", default=None, help="graph dataset for GNN apps (cora, tiny, karate, *-synthetic)")
    p.add_argument("--block", type=int, default=None, help="BigBird block size (16, 32, 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fusion", default="partial", help="unfused | partial | full | auto")
    p.add_argument("--target", default="reference", help="reference | dataflow | gpu")
    p.add_argument("--format", action="append", default=[], metavar="INPUT=FORMAT",
                   help="storage format of an input (position or name) or parameter, e.g. 0=dcsr; repeatable")


def _build(args):
    from .apps import APPS, HF_MODELS, build_hf, default_size

    if args.app in HF_MODELS:  # whole transformers models: stitchflow.compile exports them
        try:
            return build_hf(args.app, args.size or "small", seed=args.seed)
        except (ImportError, ValueError) as err:
            raise SystemExit(f"stitchflow: {err}") from err
    if args.app not in APPS:
        raise SystemExit(f"stitchflow: unknown app {args.app!r}; known: {', '.join(sorted(APPS) + sorted(HF_MODELS))}")
    return APPS[args.app].build(size=default_size(args.app, args.size, args.dataset), dataset=args.dataset,
                                block=args.block, seed=args.seed)


def _formats(items: Sequence[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"stitchflow: --format wants INPUT=FORMAT, got {item!r}")
        out[int(key) if key.isdigit() else key] = value
    return out


def _compile(args):
    import stitchflow

    model, inputs = _build(args)
    prog = stitchflow.compile(model, inputs, target=args.target, fusion=args.fusion, formats=_formats(args.format))
    return model, inputs, prog


def cmd_apps(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .apps import APPS, HF_MODELS
    from .apps.graphs import DATASETS
    from .apps.hf import PADDED

    table = Table(title="stitchflow apps")
    for col in ("app", "sizes", "description"):
        table.add_column(col)
    for name, spec in sorted(APPS.items()):
        table.add_row(name, ", ".join(spec.sizes), spec.description)
    for name, (architecture, configs, _) in sorted(HF_MODELS.items()):
        table.add_row(name, ", ".join([*configs, *PADDED]), f"Hugging Face transformers' {architecture}, randomly "
                      "initialised (needs transformers; padded sizes pass an attention_mask)")
    console = Console()
    console.print(table)
    console.print("datasets: " + ", ".join(sorted(DATASETS)))
    return 0


def cmd_ops(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .frontend.registry import catalog

    rows = [r for r in catalog() if args.grep.lower() in r["op"].lower()
            and (args.family is None or r["family"] == args.family)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no lowered op matches (grep {args.grep!r}, family {args.family}); everything else runs eagerly")
        return 0
    table = Table(title=f"ops stitchflow lowers ({len(rows)}; * refused before capture for some arguments)")
    table.add_column("family")
    table.add_column("ops")
    for family in sorted({r["family"] for r in rows}):
        names = [r["op"] + ("*" if r["refused_before_capture"] else "") for r in rows if r["family"] == family]
        table.add_row(family, ", ".join(names))
    Console().print(table)
    return 0


def cmd_show(args) -> int:
    _, _, prog = _compile(args)
    if args.json:
        print(json.dumps(program_summary(prog), indent=2))
        return 0
    print(prog.graph)
    print()
    for r in prog.regions:
        print(r)
    if args.target == "dataflow":
        inspect = importlib.import_module("stitchflow.targets.dataflow.inspect")
        print()
        print(inspect.describe(prog))
        if args.dot:
            for path in inspect.export(prog, args.dot):
                print(f"wrote {path}")
    return 0


def program_summary(prog) -> dict:
    g = prog.graph
    return {
        "target": prog.target_name,
        "fusion": prog.fusion if isinstance(prog.fusion, str) else [list(r) for r in prog.fusion],
        "inputs": {n: str(g.type_of[n]) for n in g.inputs},
        "params": {n: str(g.type_of[n]) for n in g.params},
        "nodes": [{"name": n.name, "text": str(n), "tag": str(n.tag) if n.tag else None, "group": n.group,
                   "origin": n.origin} for n in g.nodes],
        "regions": [{"name": r.name, "nodes": list(r.nodes)} for r in prog.regions],
        "outputs": list(g.outputs),
    }


def cmd_run(args) -> int:
    from rich.console import Console

    console = Console()
    t0 = time.perf_counter()
    model, inputs, prog = _compile(args)
    t1 = time.perf_counter()
    with torch.no_grad():
        expected = model(*inputs)
        t2 = time.perf_counter()
        actual = prog(*inputs)
        t3 = time.perf_counter()
    err = _relative_error(actual, expected)
    ok = err <= 1e-4
    console.print(f"[bold]{args.app}[/bold] target={args.target} fusion={args.fusion}: "
                  f"{len(prog.graph.nodes)} IR nodes in {len(prog.regions)} regions")
    console.print(f"compile {t1 - t0:.2f} s · eager {1e3 * (t2 - t1):.1f} ms · stitchflow {1e3 * (t3 - t2):.1f} ms · "
                  f"relative error vs eager {err:.2e} [{'green' if ok else 'red'}]{'OK' if ok else 'MISMATCH'}[/]")
    if args.json:
        print(json.dumps({"app": args.app, "relative_error": err, "regions": len(prog.regions),
                          "compile_s": t1 - t0, "eager_ms": 1e3 * (t2 - t1), "stitchflow_ms": 1e3 * (t3 - t2)}))
    return 0 if ok else 1


def _relative_error(actual, expected) -> float:
    if isinstance(expected, torch.Tensor):
        actual, expected = [actual], [expected]
    worst = 0.0
    for a, e in zip(actual, expected):
        a = a.to_dense().double() if a.layout != torch.strided else a.double()
        e = e.to_dense().double() if e.layout != torch.strided else e.double()
        worst = max(worst, float((a - e).norm() / e.norm().clamp_min(1e-30)))
    return worst


def cmd_explain(args) -> int:
    _, _, prog = _compile(args)
    if args.gpu_profile:
        prog.options["gpu_profile"] = args.gpu_profile
    print(prog.explain())
    return 0


_EXPLORE_HELP = """Design-space exploration (FuseFlow): granularities x dataflow orders x parallel factors x block
sizes x hoisting, pruned by the static estimate, survivors evaluated in parallel (simulated on the
dataflow target). Writes the table as CSV and JSON, and the speedups over unfused as a PNG.

    stitchflow explore gcn --dataset cora --orders --par 1 4 --block 16 32
"""


def _explore_args(p: argparse.ArgumentParser) -> None:
    from .planner.prune import COST_FACTOR, PRUNE_FACTOR

    p.add_argument("app", help="app name (see `stitchflow apps`)")
    p.add_argument("--dataset", default=None, help="graph dataset for GNN apps (cora, tiny, karate, ...)")
    p.add_argument("--size", default=None, help="app size (small, default, or a preset)")
    p.add_argument("--target", default="dataflow", choices=("dataflow", "gpu"))
    p.add_argument("--orders", nargs="*", default=None, metavar="K",
                   help="dataflow orders to sweep: indices into each region's legal orders, or 'tokens' "
                        "(the order with the fewest estimated tokens; the default ranks by estimated "
                        "cycles); the flag alone sweeps 0..3 as well as the best order")
    p.add_argument("--par", nargs="+", default=["1"], metavar="PAR",
                   help="parallel factors: 1, 4 (i), 4x4 (i and j nested), or i=4,k=4")
    p.add_argument("--block", nargs="+", type=int, default=None, metavar="B",
                   help="sparsity block sizes to sweep (for gpt3-bigbird also the mask's block)")
    p.add_argument("--executor", default=None, metavar="ADDR", help="tcp://scheduler:port for a Dask cluster")
    p.add_argument("--out", default="explore_out", help="directory for the CSV, JSON and PNG")
    p.add_argument("--factor", type=float, default=PRUNE_FACTOR, help="pruning factor over unfused FLOPs/bytes")
    p.add_argument("--cost-factor", type=float, default=COST_FACTOR,
                   help="pruning factor over the unfused static cost (cycles or seconds)")
    p.add_argument("--streamed", nargs="*", default=["full"], metavar="GRAN",
                   help="granularities also run with hoist=False (FuseFlow's streamed recomputation); "
                        "default: full; the flag alone: none")
    p.add_argument("--seed", type=int, default=0)


def _order_knob(text: str) -> int | str:
    if text == "tokens":
        return text
    try:
        return int(text)
    except ValueError:
        raise SystemExit(f"stitchflow explore: --orders takes order indices or 'tokens', got {text!r}") from None


def cmd_explore(args) -> int:
    from rich.console import Console

    from .apps.explore import explore
    from .explore import parse_par
    from .explore.report import render_table

    orders: list = [None]
    if args.orders is not None:
        orders += [_order_knob(k) for k in args.orders] if args.orders else [0, 1, 2, 3]
    blocks = args.block or [None]
    app_block = args.block[0] if args.block and args.app == "gpt3-bigbird" else None
    result = explore(args.app, dataset=args.dataset, target=args.target, orders=orders,
                     par=[parse_par(p) for p in args.par], blocks=blocks, executor=args.executor,
                     out_dir=args.out, size=args.size, seed=args.seed, factor=args.factor, app_block=app_block,
                     streamed=args.streamed, cost_factor=args.cost_factor)
    console = Console()
    if not console.is_terminal:  # a log or a pipe: do not fold the table into 80 columns
        console = Console(width=220)
    console.print(render_table(result))
    for note in result.notes:
        console.print(f"note: {note}")
    for path in result.files:
        console.print(f"wrote {path}")
    return 0


def _simulate_args(p: argparse.ArgumentParser) -> None:
    from .targets.dataflow.simulate import ENGINES

    p.add_argument("app", help="an app of the zoo (stitchflow apps)")
    p.add_argument("--dataset", default=None, help="dataset of a graph app (cora, ...) or a size (small, default)")
    p.add_argument("--size", default=None, help="app size: small | default")
    p.add_argument("--fusion", default="full", help="unfused | partial | full")
    p.add_argument("--order", type=int, default=None, help="index into the legal dataflow orders")
    p.add_argument("--order-by", choices=("cycles", "tokens"), default="cycles",
                   help="how each region's default order is chosen: by estimated cycles (critical path) "
                        "or by estimated tokens")
    p.add_argument("--par", action="append", default=[], metavar="LEVEL:P", help="parallel lanes at a level")
    p.add_argument("--block", type=int, default=None, help="sparsity blocking b (16, 32, 64)")
    p.add_argument("--channel-depth", type=int, default=None, help="bounded channels (default unbounded)")
    p.add_argument("--memory-model", action="store_true", help="round-robin memory channels")
    p.add_argument("--engine", choices=list(ENGINES), default="fast",
                   help="fast: closed forms (compiled stepping with bounded channels); stepped: compiled "
                        "stepping always; reference: Python stepping (small graphs)")
    p.add_argument("--json", action="store_true", help="print JSON")


def cmd_simulate(args) -> int:
    import stitchflow

    from .apps import APPS
    from .targets.dataflow.simulate import simulate

    options = {} if args.order_by == "cycles" else {"order_by": args.order_by}
    if args.order is not None:
        options["order"] = args.order
    if args.par:
        options["par"] = {lv: int(n) for lv, n in (x.split(":") for x in args.par)}
    if args.block:
        options["block"] = args.block
    kw = {}
    if args.dataset:
        kw["dataset"] = args.dataset
    if args.size:
        kw["size"] = args.size
    if args.app not in APPS:
        raise SystemExit(f"stitchflow: unknown app {args.app!r} for the dataflow simulator; known: "
                         f"{', '.join(sorted(APPS))}")
    model, inputs = APPS[args.app].build(**kw)
    prog = stitchflow.compile(model, inputs, target="dataflow", fusion=args.fusion, options=options)
    res = simulate(prog, prog._bind(inputs), engine=args.engine, progress=not args.json,
                   channel_depth=args.channel_depth, memory_model=args.memory_model)
    if args.json:
        print(json.dumps(res.as_dict(), indent=1))
    else:
        print(f"{args.app} {args.fusion}: {res.cycles:,} cycles, {res.flops:,} FLOPs, {res.bytes:,} bytes, "
              f"{res.tokens / max(res.seconds, 1e-9) / 1e6:.1f} M tokens/s ({res.seconds:.1f} s)")
        print(res)
    return 0


def cmd_bench(args) -> int:
    suites = {"stitching": "stitchflow.bench.stitching", "blocks": "stitchflow.bench.stitching_blocks",
              "chains": "stitchflow.bench.chains",
              "gnn": "stitchflow.bench.gnn", "attention": "stitchflow.bench.attention",
              "simulator": "stitchflow.bench.simulator", "training": "stitchflow.bench.training"}
    if args.suite not in suites:
        raise SystemExit(f"stitchflow: unknown benchmark suite {args.suite!r}; known: {', '.join(suites)}")
    try:
        module = importlib.import_module(suites[args.suite])
    except ImportError as err:
        raise SystemExit(f"stitchflow: benchmark suite {args.suite!r} is not available: {err}") from err
    return module.main(args.rest) or 0


CACHE_PARTS = {"plans": ("plans",), "gpu": ("gpu",), "all": ("plans", "gpu")}


def _cache_entries(root) -> list[dict]:
    """One entry per directory or file directly under the cache root and under gpu/: files and bytes."""
    def walk(path):
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
        return {"path": str(path.relative_to(root)), "files": len(files), "bytes": sum(f.stat().st_size for f in files)}

    tops = sorted(root.iterdir()) if root.is_dir() else []
    out = []
    for top in tops:
        out += [walk(p) for p in sorted(top.iterdir())] if top.name == "gpu" and top.is_dir() else [walk(top)]
    return out


def cmd_cache(args) -> int:
    import shutil

    from rich.console import Console
    from rich.table import Table

    from .ir.paths import cache_root

    root = cache_root()
    if args.clear:
        for part in CACHE_PARTS[args.clear]:
            target = root / part
            if target.exists():
                shutil.rmtree(target)
                print(f"removed {target}")
        return 0
    entries = _cache_entries(root)
    if args.json:
        print(json.dumps({"root": str(root), "entries": entries}, indent=1))
        return 0
    table = Table(title=f"stitchflow cache: {root} ($STITCHFLOW_CACHE)")
    for col in ("entry", "files", "MB"):
        table.add_column(col, justify="left" if col == "entry" else "right")
    for e in entries:
        table.add_row(e["path"], str(e["files"]), f"{e['bytes'] / 1e6:.2f}")
    console = Console()
    console.print(table)
    console.print("compiled kernels are in Triton's cache ($TRITON_CACHE_DIR, default ~/.triton/cache)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stitchflow", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    p = verbs.add_parser("apps", help="list the app zoo and datasets")
    p.set_defaults(fn=cmd_apps)
    p = verbs.add_parser("ops", help="list the PyTorch ops stitchflow lowers to its IR (everything else runs eagerly)")
    p.add_argument("--grep", default="", help="only ops whose name contains this text (any case)")
    p.add_argument("--family", default=None, help="only one family: elementwise, reduce, shape, linalg, conv, pool, resize")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(fn=cmd_ops)
    p = verbs.add_parser("show", help="print the captured IR and fusion regions of an app")
    _app_args(p)
    p.add_argument("--json", action="store_true", help="print a JSON summary instead")
    p.add_argument("--dot", default=None, metavar="PREFIX", help="dataflow target: write DOT/JSON (and SVG) files")
    p.set_defaults(fn=cmd_show)
    p = verbs.add_parser("run", help="compile an app, run it, compare with eager PyTorch and time both")
    _app_args(p)
    p.add_argument("--json", action="store_true", help="also print the result as JSON")
    p.set_defaults(fn=cmd_run)
    p = verbs.add_parser("explain", help="why each pair of neighbouring ops is or is not fused")
    _app_args(p)
    p.add_argument("--gpu-profile", default=None, metavar="NAME",
                   help="gpu target: rank chain plans for this GPU (e.g. 'H100', 'H200'; default: this machine's)")
    p.set_defaults(fn=cmd_explain)
    p = verbs.add_parser("explore", help="design-space exploration: granularities x orders x parallel factors x blocks",
                         description=_EXPLORE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _explore_args(p)
    p.set_defaults(fn=cmd_explore)
    p = verbs.add_parser("simulate", help="cycle-level simulation of an app on the dataflow target")
    _simulate_args(p)
    p.set_defaults(fn=cmd_simulate)
    p = verbs.add_parser("bench", help="run a benchmark suite: stitching | blocks | chains | gnn | attention | "
                                       "training (GPU), simulator (CPU)")
    p.add_argument("suite", help="stitching (memory-intensive patterns) | blocks (transformer blocks and Hugging Face "
                                 "models end to end) | chains (GEMM -> act -> GEMM) | gnn | attention | training | "
                                 "simulator")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the suite (see `stitchflow bench SUITE --help`)")
    p.set_defaults(fn=cmd_bench)
    p = verbs.add_parser("cache", help="list what stitchflow keeps on disk between processes (plans, kernels, "
                                       "chosen configs), or clear it")
    p.add_argument("--clear", choices=sorted(CACHE_PARTS), default=None,
                   help="remove the planner's plans, the gpu target's sources and choices, or both")
    p.add_argument("--json", action="store_true", help="print the entries as JSON")
    p.set_defaults(fn=cmd_cache)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .ir.errors import StitchflowError

    try:
        return args.fn(args)
    except StitchflowError as err:
        print(f"stitchflow: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
