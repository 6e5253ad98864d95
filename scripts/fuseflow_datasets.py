"""FuseFlow's table across its other data sets and block sizes (``fuseflow_findings.py --only datasets``).

GNNs on the synthetic stand-ins for Cora-ML, DBLP, ogbl-collab and ogbn-mag (apps/graphs.DATASETS:
Chung-Lu power-law graphs with the real node and edge counts) at the real sets' feature widths and
class counts (GNN_DATASETS), the sparse autoencoder's presets, and one GPT-3-small BigBird decoder at
blocks 32 and 64. Every configuration runs in a forked child under a memory cap and a time limit:
one that passes either is reported as not simulated, with what it had reached, never estimated.
"""

from __future__ import annotations

import json
import os
import signal
import time

import torch

from stitchflow.apps import APPS, GCN, SAE_PRESETS, GraphSAGE, load_dataset

# real feature widths and classes: PyG CitationFull Cora_ML (2,879 features, 7 classes) and DBLP
# (1,639, 4); ogbl-collab and ogbn-mag papers carry 128-d word2vec features (collab has no classes:
# link prediction; the GNN builder's 8 for unlabelled sets; mag's venues are 349 classes)
GNN_DATASETS = {"cora-ml-synthetic": ("Cora-ML", 2879, 7), "dblp-synthetic": ("DBLP", 1639, 4),
                "collab-synthetic": ("Collab", 128, 8), "mag-synthetic": ("MAG", 128, 349)}
GNN_PUBLISHED = {  # workloads.md, speedup over unfused: (partial, full)
    ("gcn", "cora-ml-synthetic"): (1.88, 0.14), ("gcn", "dblp-synthetic"): (1.49, 0.26),
    ("gcn", "collab-synthetic"): (2.58, 0.019), ("gcn", "mag-synthetic"): (2.13, 0.086),
    ("graphsage", "cora-ml-synthetic"): (1.85, 0.22), ("graphsage", "dblp-synthetic"): (2.02, 0.35),
    ("graphsage", "collab-synthetic"): (3.11, 0.028), ("graphsage", "mag-synthetic"): (3.92, 0.035)}
SAE_PUBLISHED = {"imagenet": (1.00, 0.67), "nih-cxr": (1.00, 0.63), "luna16": (1.00, 0.63)}
GPT3_PUBLISHED = {16: (1.75, 2.70), 32: (1.65, 2.45), 64: (1.69, 2.52)}

GNN_CONFIGS = [("unfused", "unfused", {}), ("partial", "partial", {}),
               ("full, hoist=False", "full", {"hoist": False}), ("full, hoisted", "full", {})]
PLAIN_CONFIGS = [("unfused", "unfused", {}), ("partial", "partial", {}), ("full", "full", {})]
SAE_CONFIGS = PLAIN_CONFIGS + [("full, hoist=False", "full", {"hoist": False})]  # FuseFlow's fully streamed form


def build_gnn(app: str, dataset: str, features: int):
    classes = GNN_DATASETS[dataset][2]
    data = load_dataset(dataset, feature_dim=features)
    model = (GCN if app == "gcn" else GraphSAGE)(features, 16, classes)
    return model.eval(), (data.adjacency("csr"), data.x), data


def recompute_ratio(data, cora) -> float:
    """How much more layer-1 work full fusion with hoist=False recomputes than on Cora: it redoes
    row j of A·X (deg(j)·F products) for every non-zero (i, j) of A, so it grows with
    sum_(i,j) deg(j)·F = sum_j deg(j)^2·F. A count of the graph, not of the simulator."""
    def work(g):
        return float((g.degrees().double() ** 2).sum()) * g.num_features
    return work(data) / work(cora)


def _rss_kb(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def guarded(fn, mem_gb: float, limit_s: float) -> dict:
    """fn() -> dict, run in a forked child that is killed past `mem_gb` of resident memory or
    `limit_s` seconds; returns its dict with peak_gb, or {"skipped": why, ...}."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        # the parent's OpenMP pool does not survive fork: the child's first parallel torch op (MAG's
        # products in capture) waited on it forever. One thread runs ops inline (the simulator is numpy).
        torch.set_num_threads(1)
        try:
            out = fn()
        except Exception as e:  # reported, not raised: the other rows go on
            out = {"skipped": f"error: {type(e).__name__}: {e}"[:300]}
        out["peak_gb"] = round(_rss_kb(os.getpid(), "VmHWM") / 2**20, 2)
        with os.fdopen(w, "w") as f:
            json.dump(out, f, default=str)
        os._exit(0)
    os.close(w)
    t0, peak, why = time.perf_counter(), 0, None
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        rss = _rss_kb(pid, "VmRSS")
        peak = max(peak, rss)
        elapsed = time.perf_counter() - t0
        if rss > mem_gb * 2**20 or elapsed > limit_s:
            why = (f"not simulated: over {mem_gb:g} GB of memory after {elapsed:.0f} s" if rss > mem_gb * 2**20
                   else f"not simulated: over {limit_s:.0f} s (at {rss / 2**20:.1f} GB)")
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.5)
    with os.fdopen(r) as f:
        text = f.read()
    if why is not None or not text:
        return {"skipped": why or "child died without a result", "peak_gb": round(peak / 2**20, 2)}
    return json.loads(text)


def add_ratios(row: dict, base: dict) -> None:
    """speedup (base cycles over the row's), FLOPs and bytes as ratios to `base` (unfused), where both
    were simulated."""
    if "cycles" in row and "cycles" in base:
        row.update(speedup=base["cycles"] / row["cycles"], flops_x=row["flops"] / base["flops"],
                   bytes_x=row["bytes"] / base["bytes"])


def run_configs(measure, app, model, inputs, configs, published, mem_gb, limit_s, skip=None, log=None, **extra):
    """The configurations of one app / data set; `skip`: {label: why} not run at all. `published`:
    (partial, full) speedups or None. Each row goes to `log(row)` as soon as it is done."""
    rows = []
    for label, fusion, options in configs:
        t0 = time.perf_counter()
        if skip and label in skip:
            row = {"skipped": skip[label]}
        else:
            row = guarded(lambda: measure(model, inputs, fusion, options), mem_gb, limit_s)
        row.update(app=app, config=label, fusion=fusion, wall_s=round(time.perf_counter() - t0, 1), **extra)
        rows.append(row)
        if log:
            log(row)
        print(f"# {app} {extra} {label}: {row.get('cycles', row.get('skipped'))} (peak {row.get('peak_gb')} GB, "
              f"{row['wall_s']} s)", flush=True)
    base = rows[0]
    for row in rows:
        add_ratios(row, base)
        pub = dict(zip(("partial", "full"), published or ()))
        row["published"] = pub.get(row["fusion"]) if row["config"] != "full, hoisted" else None
    return rows


def dataset_table(rows, title, caption=""):
    out = [f"**{title}**" + (f" ({caption})" if caption else ""), "",
           "| config | regions | cycles | speedup | FuseFlow | FLOPs ×unfused | bytes ×unfused | tokens | sim s "
           "| peak GB | max err |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r.get("published")
        pub = "–" if p is None else f"{p:.2f}" if p >= 0.1 else f"{p:.3g}"
        if "cycles" not in r:
            out.append(f"| {r['config']} | | {r['skipped']} | | {pub} | | | | | {r.get('peak_gb', '')} | |")
            continue
        ratio = (lambda k: f"{r[k]:.2f}") if "speedup" in r else (lambda k: "")
        spd = f"**{r['speedup']:.2f}×**" if "speedup" in r and r.get("published") else (
            f"{r['speedup']:.2f}×" if "speedup" in r else "(no unfused)")
        out.append(f"| {r['config']} | {r['regions']} | {r['cycles']:,} | {spd} | {pub} | {ratio('flops_x')} | "
                   f"{ratio('bytes_x')} | {r['tokens']:,} | {r['sim_s']} | {r.get('peak_gb', '')} | "
                   f"{r.get('max_err', float('nan')):.1e} |")
    return "\n".join(out)


def gnn_part(measure, apps, datasets, mem_gb, limit_s, hoist_false=(), log=None, features=None, configs=None):
    """GCN and GraphSAGE on each data set; full with hoist=False only on the data sets in
    `hoist_false` (elsewhere skipped with the graph's recomputation count against Cora's).
    `features`: {data set: feature width} where not the real set's (GNN_DATASETS); `configs`: the labels of
    GNN_CONFIGS to run (default all; the others make no row, so that a --jsonl run can fill in a table)."""
    cora = load_dataset("cora")
    results, md = {}, []
    for dataset in datasets:
        name, real, classes = GNN_DATASETS[dataset]
        width = (features or {}).get(dataset, real)
        for app in apps:
            model, inputs, data = build_gnn(app, dataset, width)
            skip = None
            if dataset not in hoist_false:
                ratio = recompute_ratio(data, cora)
                skip = {"full, hoist=False": f"not run: recomputes Σ deg(j)²·F = {ratio:.0f}× Cora's layer-1 work "
                        f"(Cora: 2.27 G tokens, 18-19 GB)"}
            chosen = [c for c in GNN_CONFIGS if configs is None or c[0] in configs]
            rows = run_configs(measure, app, model, inputs, chosen, GNN_PUBLISHED[(app, dataset)], mem_gb,
                               limit_s, skip, log, dataset=dataset, features=width)
            results[f"{app}:{dataset}"] = rows
            title = f"{'GCN' if app == 'gcn' else 'GraphSAGE'}, {name} (`{dataset}`)"
            md += [dataset_table(rows, title, f"{data.num_nodes:,} nodes, {data.num_edges():,} non-zeros, "
                                 f"{width:,} features" + (f" (real set: {real:,})" if width != real else "")
                                 + f", hidden 16, {classes} classes"), ""]
            del model, inputs, data
    return results, md


def sae_part(measure, presets, mem_gb, limit_s, log=None):
    results, md = {}, []
    for preset in presets:
        model, inputs = APPS["sae"].build(size=preset)
        rows = run_configs(measure, "sae", model, inputs, SAE_CONFIGS, SAE_PUBLISHED[preset], mem_gb, limit_s,
                           log=log, dataset=preset)
        results[f"sae:{preset}"] = rows
        features, hidden = SAE_PRESETS[preset]
        md += [dataset_table(rows, f"SAE, {preset}", f"batch {inputs[0].shape[0]}, {features:,} → {hidden} → "
                             f"{features:,}, weights 90% sparse"), ""]
        del model, inputs
    return results, md


def gpt3_part(measure, blocks, mem_gb, limit_s, log=None):
    results, md = {}, []
    for b in blocks:
        model, inputs = APPS["gpt3-bigbird"].build(size="decoder", block=b)
        configs = [(label, fusion, {"block": b}) for label, fusion, _ in PLAIN_CONFIGS]
        rows = run_configs(measure, "gpt3-bigbird", model, inputs, configs, GPT3_PUBLISHED[b], mem_gb, limit_s,
                           log=log, block=b)
        rows[-1]["published"] = None  # FuseFlow's "full" is the 12-decoder count (fuseflow-full), not one region
        results[f"gpt3-bigbird:b{b}"] = rows
        md += [dataset_table(rows, f"GPT-3-small BigBird, one decoder, block {b}",
                             f"sparsity blocking {b}×{b}; FuseFlow partial {GPT3_PUBLISHED[b][0]}, "
                             f"full {GPT3_PUBLISHED[b][1]} (12 decoders, see fuseflow-full)"), ""]
    return results, md


def render_jsonl(path: str) -> list:
    """Markdown tables from the rows a run appended with --jsonl (several runs, e.g. in pieces):
    grouped by app, data set, feature width and block, ratios to each group's unfused row."""
    groups: dict = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            key = (row["app"], row.get("dataset"), row.get("features"), row.get("block"))
            groups.setdefault(key, {})[row["config"]] = row  # a later run of a configuration wins
    kinds = ["gcn", "graphsage", "gpt3-bigbird", "sae"]
    names = list(GNN_DATASETS) + list(SAE_PRESETS)

    def rank(key):
        app, dataset, features, block = key
        return (app not in ("gcn", "graphsage"), names.index(dataset) if dataset in names else 0,
                kinds.index(app), -(features or GNN_DATASETS.get(dataset, (0, 1 << 30))[1]), block or 0)

    md = []
    for (app, dataset, features, block), by_config in sorted(groups.items(), key=lambda kv: rank(kv[0])):
        rows = list(by_config.values())
        base = by_config.get("unfused", {})
        pub = (GNN_PUBLISHED.get((app, dataset)) if app in ("gcn", "graphsage") else
               SAE_PUBLISHED.get(dataset) if app == "sae" else (GPT3_PUBLISHED[block][0], None))
        for row in rows:
            row["published"] = None if row["config"] == "full, hoisted" else dict(zip(("partial", "full"), pub)).get(
                row["fusion"])
            add_ratios(row, base)
        if app in ("gcn", "graphsage"):
            name, real, classes = GNN_DATASETS[dataset]
            features = features or real
            title = f"{'GCN' if app == 'gcn' else 'GraphSAGE'}, {name} (`{dataset}`)"
            caption = (f"{features:,} features" + (f" (real set: {real:,})" if features != real else "")
                       + f", hidden 16, {classes} classes")
        elif app == "sae":
            title, caption = f"SAE, {dataset}", "batch 32, {:,} → {} → {:,}, weights 90% sparse".format(
                SAE_PRESETS[dataset][0], SAE_PRESETS[dataset][1], SAE_PRESETS[dataset][0])
        else:
            title = f"GPT-3-small BigBird, one decoder, block {block}"
            caption = f"sparsity blocking {block}×{block}; FuseFlow's full is the 12-decoder count, below"
        md += [dataset_table(rows, title, caption), ""]
    return md
