"""FuseFlow's findings (issue 4) on the dataflow simulator's fast engine, side by side with its
published speedups (../shared/spec/workloads.md). Prints the markdown tables of BENCHMARKS.md.

    .venv/bin/python scripts/fuseflow_findings.py                 # everything (~25-30 min on 2 cores)
    .venv/bin/python scripts/fuseflow_findings.py --only gnn      # gnn | gpt3 | par | fuseflow-full, comma separated
    .venv/bin/python scripts/fuseflow_findings.py --no-hoisted    # skip full fusion with default hoisting
    .venv/bin/python scripts/fuseflow_findings.py --only datasets --datasets cora-ml-synthetic,dblp-synthetic
        --features dblp-synthetic=512 --blocks 32,64 --sae imagenet,luna16 --jsonl rows.jsonl  # other data sets
    .venv/bin/python scripts/fuseflow_findings.py --only fuseflow-full --blocks 32,64   # FuseFlow's full GPT-3
    .venv/bin/python scripts/fuseflow_findings.py --render rows.jsonl   # the datasets tables of (pieced) runs

speedup = unfused cycles / configuration cycles; FLOPs and bytes are ratios to unfused.
GNNs: GCN and GraphSAGE on Cora (size "default"), unfused / per-layer partial / full with
FuseFlow's fully streamed recomputation (hoist=False) / full with hoisting (the default).
GPT-3: one GPT-3-small decoder with BigBird attention, seq 1024, block 16, simulated with
sparsity blocking (options block=16: 16x16 tiles, ~1000x fewer tokens than scalar).
par: the partially fused attention region of that decoder with 1, 2, 4 lanes over heads and
4 lanes over its outermost output level and 4 x 4 over query rows x heads (its own cycles, the
other regions left out).
fuseflow-full: FuseFlow's fully fused GPT-3 (each decoder's FFN region with the next decoder's
LN+QKV) on two full-size decoders, counted over 12 decoders as FuseFlow's artifact counts it
(at every block of --blocks, default 16).
datasets: FuseFlow's table over its other data sets (scripts/fuseflow_datasets.py): GNNs on the
synthetic Cora-ML / DBLP / Collab / MAG (--datasets, at the real sets' feature widths), the SAE
presets (--sae) and the GPT-3 decoder at --blocks; each configuration in a child process that is
stopped past --mem-gb or --limit-s and reported as not simulated. Full with hoist=False runs only
on --hoist-false data sets; --features sets other widths (e.g. dblp-synthetic=512). --jsonl appends
every row as it finishes, --render prints the tables of such rows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import time

import torch

import stitchflow
from stitchflow.apps import APPS
from stitchflow.targets.dataflow import dataflows
from stitchflow.targets.dataflow.chunked import CHUNK_TOKENS
from stitchflow.targets.dataflow.simulate import run_region
from stitchflow.targets.dataflow.timing import Timing

# FuseFlow's simulated speedups over unfused (workloads.md): Cora, and GPT-3 BigBird b16
PUBLISHED = {("gcn", "partial"): 1.63, ("gcn", "full"): 0.29,
             ("graphsage", "partial"): 2.10, ("graphsage", "full"): 0.48,
             ("gpt3-bigbird", "partial"): 1.75, ("gpt3-bigbird", "full"): 2.70}

GNN_CONFIGS = [("unfused", "unfused", {}), ("partial", "partial", {}),
               ("full, hoist=False", "full", {"hoist": False}), ("full, hoisted", "full", {})]
GPT3_CONFIGS = [("unfused", "unfused", {"block": 16}), ("partial", "partial", {"block": 16}),
                ("full", "full", {"block": 16})]


SIM = {"chunk_tokens": CHUNK_TOKENS}  # --chunk-tokens (forked children inherit it)


def measure(model, inputs, fusion, options, check=True):
    t0 = time.perf_counter()
    prog = stitchflow.compile(model, inputs, target="dataflow", fusion=fusion, options=options)
    compile_s = time.perf_counter() - t0
    sim = prog.simulate(*inputs, chunk_tokens=SIM["chunk_tokens"])
    row = dict(cycles=int(sim.cycles), flops=int(sim.flops), bytes=int(sim.bytes), tokens=int(sim.tokens),
               regions=len(sim.regions), compile_s=round(compile_s, 1), sim_s=round(sim.seconds, 1),
               tokens_per_s=sim.tokens / sim.seconds, orders=[" ".join(map(str, d.order)) for d in dataflows(prog)])
    if check:
        with torch.no_grad():
            ref = model(*inputs)
        row["max_err"] = float((sim.outputs - ref).abs().max())
    return row


def app_rows(app, build_kw, configs, skip=()):
    model, inputs = APPS[app].build(**build_kw)
    rows = []
    for label, fusion, options in configs:
        if label in skip:
            continue
        row = measure(model, inputs, fusion, options)
        row.update(app=app, config=label, fusion=fusion)
        rows.append(row)
        print(f"# {app} {label}: {row['cycles']:,} cycles, sim {row['sim_s']} s", flush=True)
    base = rows[0]
    for row in rows:
        row["speedup"] = base["cycles"] / row["cycles"]
        row["flops_x"] = row["flops"] / base["flops"]
        row["bytes_x"] = row["bytes"] / base["bytes"]
        row["published"] = PUBLISHED.get((app, row["fusion"]))
    return rows


def _attention(prog):
    """The attention region's dataflow: the one that loads the BigBird block mask."""
    return [df for df in dataflows(prog)
            if any(p.kind == "load" and "mask" in str(p.param("tensor")) for p in df.prims)][0]


def attention_par_rows(block=16, order=None):
    """The attention region of the partially fused decoder, 1 / 2 / 4 / 4x4 lanes: the regions
    before it run functionally, then it alone is simulated."""
    from stitchflow.targets.dataflow.target import CompiledRegion

    model, inputs = APPS["gpt3-bigbird"].build(size="decoder", block=block)
    base = {"block": block} | ({"order": {"matmul_1": order}} if order else {})
    plain = stitchflow.compile(model, inputs, target="dataflow", fusion="partial", options=base)
    attn = _attention(plain)
    from stitchflow.targets.dataflow.rexpr import free

    (expr,) = [c.exprs for c in plain._compiled if getattr(c, "dataflow", None) is attn][0].values()
    extents = dict(attn.extents)
    outs = sorted(free(expr), key=lambda v: (extents[v], v))
    head, row = outs[0], outs[-1]  # the heads (12) and the query rows (seq); the head dim between
    outer, inner = sorted((head, row), key=attn.order.index)  # two parallel levels, outer first
    rows = []
    for label, par in [("1", {}), ("2", {outer: 2}), ("4", {outer: 4}), ("4x4", {outer: 4, inner: 4})]:
        prog = stitchflow.compile(model, inputs, target="dataflow", fusion="partial",
                                  options=base | {"par": par})
        target = _attention(prog)
        env = prog._bind(inputs)
        for c in prog._compiled:
            if isinstance(c, CompiledRegion) and c.dataflow is target:
                t0 = time.perf_counter()
                res = run_region(target, env, Timing.make())
                break
            c(env)
        rows.append(dict(lanes=label, par=dict(par), cycles=int(res.cycles), tokens=int(res.counters.tokens),
                         sim_s=round(time.perf_counter() - t0, 1)))
        print(f"# attention {label} lanes: {res.cycles:,} cycles", flush=True)
    for r in rows:
        r["speedup"] = rows[0]["cycles"] / r["cycles"]
    return dict(region=attn.region, order=" ".join(attn.order), rows=rows, heads=head, rows_var=row)


def fuseflow_full_rows(reuse_limits=(None, 16), block=16):
    """FuseFlow's "fully fused" GPT-3 counted as its artifact counts it (run_figure12_benchmarks.py):
    per-layer's regions with each decoder's FFN region also taking the next decoder's LN+QKV, over
    12 decoders = LN+QKV once + 12 attentions + 11 FFN regions with the next LN+QKV + the last FFN
    region. Simulated on two full-size decoders (seq 1024, width 768, `block`), whose five regions
    are those components; unfused and per-layer are 12 times one decoder's. `reuse_limit`: the
    target's option (None: the default, which plans a region of more than 16 nodes both with its
    reused producers buffered and inlined and keeps the faster by estimate; 16: always buffered)."""
    from stitchflow.apps.gpt3 import GPT3
    from stitchflow.planner.granularity import gpt3_fuseflow_full
    from stitchflow.program import capture_model

    model = GPT3.preset("gpt3-small", num_layers=2, block=block).eval()
    x = torch.randn(1024, 768, generator=torch.Generator().manual_seed(0))
    ((_, groups),) = gpt3_fuseflow_full(capture_model(model, (x,), None).graph)
    with torch.no_grad():
        ref = model(x)
    rows = []
    for limit in reuse_limits:
        options = {"block": block} | ({"reuse_limit": limit} if limit else {})
        prog = stitchflow.compile(model, (x,), target="dataflow", fusion=groups, options=options)
        sim = prog.simulate(x)
        qkv, attn, tail_next, _, tail = (r.cycles for r in sim.regions)
        rows.append(dict(block=block, reuse_limit=limit or "default", ln_qkv=qkv, attention=attn,
                         ffn_next_qkv=tail_next, ffn=tail, decoders12=qkv + 12 * attn + 11 * tail_next + tail,
                         max_err=float((sim.outputs - ref).abs().max())))
        print(f"# fuseflow full, reuse_limit {limit}: {rows[-1]}", flush=True)
    return rows


def datasets_part(args, results) -> list:
    """FuseFlow's other data sets and blocks (scripts/fuseflow_datasets.py), markdown lines."""
    import fuseflow_datasets as D

    def log(row):
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")

    def names(text):
        return [] if text in ("", "none") else text.split(",")

    md = []
    guard = dict(mem_gb=args.mem_gb, limit_s=args.limit_s, log=log)
    apps = [a for a in args.apps.split(",") if a in ("gcn", "graphsage")]
    widths = {k: int(v) for k, v in (f.split("=") for f in names(args.features))}
    for part, md_part in [D.gnn_part(measure, apps, names(args.datasets), hoist_false=names(args.hoist_false),
                                      features=widths, configs=re.split(r",(?! )", args.configs) if args.configs else None, **guard),
                          D.gpt3_part(measure, [int(b) for b in names(args.blocks or "32,64")], **guard),
                          D.sae_part(measure, names(args.sae), **guard)]:
        results.update(part)
        md += md_part
    return md


def table(rows, title):
    out = [f"**{title}**", "",
           "| config | regions | cycles | speedup | FuseFlow | FLOPs ×unfused | bytes ×unfused | tokens | sim s | tokens/s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pub = f"{r['published']:.2f}" if r["published"] is not None and r["config"] != "full, hoisted" else "–"
        out.append(f"| {r['config']} | {r['regions']} | {r['cycles']:,} | {r['speedup']:.2f}× | {pub} | "
                   f"{r['flops_x']:.2f} | {r['bytes_x']:.2f} | {r['tokens']:,} | {r['sim_s']} | "
                   f"{r['tokens_per_s'] / 1e6:.1f} M |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="gnn,gpt3,par,fuseflow-full")
    ap.add_argument("--no-hoisted", action="store_true", help="skip full fusion with default hoisting (GNNs)")
    ap.add_argument("--apps", default="gcn,graphsage", help="GNN apps (with --only gnn)")
    ap.add_argument("--json", help="also write the raw numbers here")
    ap.add_argument("--datasets", default="cora-ml-synthetic,dblp-synthetic,collab-synthetic,mag-synthetic",
                    help="GNN data sets (with --only datasets; 'none' for none)")
    ap.add_argument("--sae", default="imagenet,luna16,nih-cxr", help="SAE presets (with --only datasets)")
    ap.add_argument("--blocks", help="GPT-3 BigBird blocks, comma separated (default: 32,64 with datasets, "
                    "16 with fuseflow-full)")
    ap.add_argument("--hoist-false", default="", help="data sets on which to run full with hoist=False")
    ap.add_argument("--configs", default="", help="GNN configurations to run (with --only datasets), comma "
                    "separated, e.g. 'unfused,full, hoisted' split at commas not followed by a space; default all")
    ap.add_argument("--mem-gb", type=float, default=14.0, help="memory cap of one configuration (datasets)")
    ap.add_argument("--limit-s", type=float, default=900.0, help="time limit of one configuration (datasets)")
    ap.add_argument("--features", default="", help="GNN feature widths other than the real sets', "
                    "e.g. dblp-synthetic=512")
    ap.add_argument("--chunk-tokens", default=str(CHUNK_TOKENS), help="a region of more tokens is simulated in "
                    "chunks of about this many (none: every region whole); smaller chunks, less memory")
    ap.add_argument("--jsonl", help="append every datasets row here as it finishes")
    ap.add_argument("--render", metavar="JSONL", help="print the datasets tables of the rows in JSONL (appended "
                    "by --jsonl, in one run or several) and exit")
    ap.add_argument("--attention-order", help="dataflow order of the attention output (matmul_1) for "
                    "the lanes study, e.g. 'i j k k1 l' (heads outermost); default: the estimated cheapest")
    args = ap.parse_args(argv)
    SIM["chunk_tokens"] = None if args.chunk_tokens in ("none", "None") else int(float(args.chunk_tokens))
    if args.render:
        import fuseflow_datasets

        print("\n".join(fuseflow_datasets.render_jsonl(args.render)))
        return
    parts = args.only.split(",")
    skip = ("full, hoisted",) if args.no_hoisted else ()
    results: dict = dict(date=datetime.date.today().isoformat(), torch=torch.__version__,
                         machine=f"{platform.machine()}, {__import__('os').cpu_count()} CPUs")
    md = [f"machine: {results['machine']}; torch {results['torch']}; {results['date']}", ""]
    if "gnn" in parts:
        for app, title in [("gcn", "GCN, Cora"), ("graphsage", "GraphSAGE, Cora")]:
            if app not in args.apps.split(","):
                continue
            rows = app_rows(app, dict(size="default"), GNN_CONFIGS, skip)
            results[app] = rows
            md += [table(rows, title), ""]
    if "gpt3" in parts:
        rows = app_rows("gpt3-bigbird", dict(size="decoder", block=16), GPT3_CONFIGS)
        results["gpt3-bigbird"] = rows
        md += [table(rows, "GPT-3-small BigBird, one decoder, seq 1024, block 16 (sparsity blocking b=16)"), ""]
    if "datasets" in parts:
        md += datasets_part(args, results)
    if "fuseflow-full" in parts:
        rows = [r for b in map(int, (args.blocks or "16").split(","))
                for r in fuseflow_full_rows((None,) if b != 16 else (None, 16), block=b)]
        results["fuseflow_full"] = rows
        md += ["**GPT-3-small BigBird, FuseFlow's fully fused configuration over 12 decoders** (cycles)", "",
               "| block | reuse_limit | LN+QKV | attention | FFN + next LN+QKV | last FFN | 12 decoders | max err |",
               "|---|---|---|---|---|---|---|---|"]
        md += [f"| {r['block']} | {r['reuse_limit']} | {r['ln_qkv']:,} | {r['attention']:,} | {r['ffn_next_qkv']:,} | "
               f"{r['ffn']:,} | {r['decoders12']:,} | {r['max_err']:.1e} |" for r in rows]
        md.append("")
    if "par" in parts:
        par = attention_par_rows(order=args.attention_order)
        results["par"] = par
        md += [f"**Attention region `{par['region']}` (order {par['order']}), lanes**", "",
               "| lanes | par | cycles | speedup vs 1 lane |", "|---|---|---|---|"]
        md += [f"| {r['lanes']} | {r['par'] or '–'} | {r['cycles']:,} | {r['speedup']:.2f}× |" for r in par["rows"]]
        md.append("")
    print("\n".join(md))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
