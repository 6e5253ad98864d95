"""`stitchflow bench simulator`: how fast the dataflow simulator's fast engine runs (CPU only).

    stitchflow bench simulator [--app gcn] [--dataset cora] [--fusions unfused,partial,full]
        [--option hoist=false] [--out-dir DIR] [--markdown BENCHMARKS.md]

For each fusion configuration: compile for the dataflow target, simulate once, and record wall
and CPU seconds (compile included and not), tokens, tokens per second and cycles. The CPU
seconds are this process's own (`time.process_time`): on a shared box they say what the
simulator costs when the other cores are busy. Writes simulator.json / simulator.csv and,
with --markdown, the "Dataflow simulator speed" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from pathlib import Path

from .report import replace_section, write_results

SECTION = "## Dataflow simulator speed"


def time_config(model, inputs, fusion: str, options: dict) -> dict:
    import stitchflow

    wall0, cpu0 = time.perf_counter(), time.process_time()
    prog = stitchflow.compile(model, inputs, target="dataflow", fusion=fusion, options=options)
    wall1, cpu1 = time.perf_counter(), time.process_time()
    res = prog.simulate(*inputs)
    wall2, cpu2 = time.perf_counter(), time.process_time()
    sim_cpu = cpu2 - cpu1
    return {"fusion": fusion, "options": options, "regions": len(res.regions), "cycles": res.cycles,
            "tokens": res.tokens, "compile_s": round(wall1 - wall0, 2), "simulate_s": round(wall2 - wall1, 2),
            "simulate_cpu_s": round(sim_cpu, 2), "total_s": round(wall2 - wall0, 2),
            "total_cpu_s": round(cpu2 - cpu0, 2),
            "tokens_per_s": round(res.tokens / max(wall2 - wall1, 1e-9)),
            "tokens_per_cpu_s": round(res.tokens / max(sim_cpu, 1e-9))}


def run(app="gcn", dataset="cora", fusions=("unfused", "partial", "full"), options=None, progress=True):
    from stitchflow.apps import APPS

    kw = {"dataset": dataset} if dataset else {}
    model, inputs = APPS[app].build(**kw)
    rows = []
    for fusion in fusions:
        row = time_config(model, inputs, fusion, dict(options or {}))
        if progress:
            print(f"{app} {fusion}: {row['total_s']:.1f} s ({row['total_cpu_s']:.1f} s CPU), "
                  f"{row['tokens']:,} tokens, {row['tokens_per_s'] / 1e6:.1f} M tokens/s", flush=True)
        rows.append(row)
    return rows


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "")
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.machine()} {cpu}, {os.cpu_count()} CPUs, {mem:.0f} GiB"


def _cpuinfo():
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def markdown(app, dataset, rows, options, command) -> str:
    import numba
    import numpy
    import torch

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [SECTION, "",
             f"Command: `{command}`  ",
             f"Machine: {machine()}; load average {load:.1f} when it finished; "
             f"{datetime.date.today()}; torch {torch.__version__}, numpy {numpy.__version__}, "
             f"numba {numba.__version__}  ",
             f"App: {app}{' on ' + dataset if dataset else ''}; options {options or 'default'}; fast engine, "
             "unbounded channels, no memory model. Wall seconds include the other processes' "
             "contention; CPU seconds are the simulator's own.", "",
             "| fusion | regions | cycles | tokens | compile s | simulate s (CPU) | M tokens/s (per CPU s) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['fusion']} | {r['regions']} | {r['cycles']:,} | {r['tokens']:,} | {r['compile_s']:.1f} | "
                     f"{r['simulate_s']:.1f} ({r['simulate_cpu_s']:.1f}) | {r['tokens_per_s'] / 1e6:.1f} "
                     f"({r['tokens_per_cpu_s'] / 1e6:.1f}) |")
    wall = sum(r["total_s"] for r in rows)
    cpu = sum(r["total_cpu_s"] for r in rows)
    lines += ["", f"All {len(rows)} configurations, compile + simulate: **{wall:.1f} s** wall ({cpu:.1f} s CPU)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="stitchflow bench simulator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--app", default="gcn")
    p.add_argument("--dataset", default="cora")
    p.add_argument("--fusions", default="unfused,partial,full")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a dataflow target option, e.g. hoist=false")
    p.add_argument("--out-dir", default="bench-results")
    p.add_argument("--markdown", default=None, help="write the section into this BENCHMARKS.md")
    args = p.parse_args(argv)
    options = dict(_option(o) for o in args.option)
    rows = run(args.app, args.dataset or None, args.fusions.split(","), options)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_results(out, "simulator", {"app": args.app, "dataset": args.dataset, "machine": machine(), "rows": rows},
                  rows)
    if args.markdown:
        command = "stitchflow bench simulator " + " ".join(argv if argv is not None else os.sys.argv[1:])
        replace_section(Path(args.markdown), SECTION, markdown(args.app, args.dataset, rows, options, command.strip()))
    return 0


def _option(text: str):
    key, _, value = text.partition("=")
    low = value.lower()
    if low in ("true", "false"):
        return key, low == "true"
    try:
        return key, int(value)
    except ValueError:
        return key, value


if __name__ == "__main__":
    raise SystemExit(main())
