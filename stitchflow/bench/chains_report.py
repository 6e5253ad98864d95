"""The compute-chains bench's report: the BENCHMARKS.md table, issue 7's acceptance lines, and the
section rebuilt from a run's chains.json (with an earlier run's rows for the cases it did not measure)."""

from __future__ import annotations

import json
from pathlib import Path

from .report import replace_section

SECTION = "## Compute chains (GEMM → act → GEMM)"


def _us(x) -> str:
    return f"{x * 1e6:.1f}" if x else "-"


def _best_dsm(row):
    ok = [d for d in row.get("dsm", []) if "seconds" in d and d["err"] < 2e-2]
    return min(ok, key=lambda d: d["seconds"]) if ok else None


def table_lines(rows: list[dict]) -> list[str]:
    head = ("| case | floor µs (bound) | eager µs | compile µs | max-autotune µs | ours µs | ours vs eager | "
            "vs best torch | ours / floor | cluster/DSM µs (C) vs our kernel | our plan | model 1st choice / best |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        floor = max(r["hbm_floor"], r["flop_floor"])
        bound = "hbm" if r["hbm_floor"] >= r["flop_floor"] else "flop"
        torch_best = _torch_best(r)
        dsm = _best_dsm(r)
        dsm_txt = f"{_us(dsm['seconds'])} (C{dsm['cluster']}) {r['ours_kernel_s'] / dsm['seconds']:.2f}×" if dsm else "-"
        lines.append(
            f"| {r['case']} | {_us(floor)} ({bound}) | {_us(r['eager_s'])} | {_us(r.get('compile_s'))} | "
            f"{_us(r.get('max_autotune_s'))} | {_us(r['ours_s'])} | {r['eager_s'] / r['ours_s']:.2f}× | "
            f"{torch_best / r['ours_s']:.2f}× | {r['ours_s'] / floor:.2f} | {dsm_txt} | {r['plan']} | "
            f"{r['model_first_s'] / r['best_profiled_s']:.2f} |")
    return lines


def _torch_best(r) -> float:
    return min(t for t in (r["eager_s"], r.get("compile_s"), r.get("max_autotune_s")) if t)


def acceptance_lines(rows: list[dict], older: list[dict] = ()) -> list[str]:
    """Issue 7's device criteria from this run's rows; `older` (an earlier run's rows for shapes
    this run did not measure) enters each verdict too, marked "earlier"."""
    def verdict(ok):
        return "holds" if ok else "does not hold"

    every = [(r, "") for r in rows] + [(r, " (earlier)") for r in older]
    mem = [(min(r["eager_s"], r.get("compile_s") or r["eager_s"]) / r["ours_s"], tag) for r, tag in every
           if r["case"].startswith("membound")]
    m128 = next(((r, tag) for r, tag in every if r["case"] == "gpt6.7b ffn M=128"), None)
    slow = [(r["case"] + tag, _torch_best(r) / r["ours_s"]) for r, tag in every if r["ours_s"] > 1.05 * _torch_best(r)]
    within = sum(r["model_first_s"] <= 1.1 * r["best_profiled_s"] for r in rows)
    lines = [f"- Memory-bound chains ≥3× faster than eager and torch.compile: "
             f"{verdict(mem and min(x for x, _ in mem) >= 3)} "
             f"({', '.join(f'{x:.2f}×{tag}' for x, tag in mem)} over the faster of the two)."]
    if m128:
        r, tag = m128
        ratio = r["ours_s"] / max(r["hbm_floor"], r["flop_floor"])
        lines.append(f"- GPT-6.7B FFN M=128 within 1.25× of its floor and faster than eager: "
                     f"{verdict(ratio <= 1.25 and r['ours_s'] < r['eager_s'])} ({ratio:.2f}× the floor, "
                     f"{r['eager_s'] / r['ours_s']:.2f}× eager{tag}).")
    lines.append("- No shape more than 5% slower than the best of eager and torch.compile: "
                 f"{verdict(not slow)}" + (f" ({', '.join(f'{n} {x:.2f}×' for n, x in slow)})." if slow else "."))
    old_within = sum(r["model_first_s"] <= 1.1 * r["best_profiled_s"] for r in older)
    lines.append(f"- Cost model's first choice within 10% of the best profiled plan on ≥80% of shapes: "
                 f"{verdict(within >= 0.8 * len(rows))} over this run's shapes ({within}/{len(rows)}"
                 + (f"; the earlier run's rows: {old_within}/{len(older)}"
                    if older else "") + ").")
    return lines


def section_text(meta: dict, rows: list[dict], checks: list[dict], earlier: dict | None = None) -> str:
    """The BENCHMARKS.md section; `earlier` (an older chains.json) lists the cases this run
    did not measure, labelled with that run's date and timing method."""
    probes = meta.get("probes", {})
    timing = meta.get("timing", {})
    lines = [SECTION, "",
             f"Command: `{meta['command']}`. Device: {meta['device']}; {meta['date']}; torch {meta['torch']}, "
             f"triton {meta['triton']}. Ceilings measured in the same run: copy {meta['copy_bw'] / 1e12:.2f} TB/s "
             f"(read+write), bf16 GEMM 8192³ {meta['gemm_flops'] / 1e12:.0f} TFLOP/s. Every time (eager, "
             "torch.compile, each candidate plan of ours, the cluster kernel) is the median over replays of a "
             "CUDA graph captured from the call, L2 evicted clean before each replay by reading 256 MB "
             "(targets/gpu/timing.py: do_bench's zeroing flush left dirty lines whose write-back added 9-10 µs "
             f"to each 134 MB weight stream) ({timing.get('graph', 0)} graph-timed, {timing.get('plain', 0)} fell back to plain calls); "
             "bf16 in and out, fp32 accumulation; our winner checked against eager. 'ours' = the winner among "
             "the cost model's shortlist timed on the device, timed again (its plan shown); eager, torch.compile "
             "and ours: the median of three rounds timed in turn (clock drift); 'model 1st choice / "
             "best' = time of the model's top plan over the best timed plan. Cost-model calibration probes "
             "measured in the same run (not benchmark shapes): Triton GEMM rate "
             f"{probes.get('triton_mma_eff', 0):.2f}× cuBLAS, weight streaming Triton "
             f"{probes.get('triton_stream_eff', 0):.2f}× / cuBLAS {probes.get('library_stream_eff', 0):.2f}× / Gluon "
             f"stream GEMM {probes.get('gluon_stream_eff', 0):.2f}× the "
             f"copy rate, im2col gather {probes.get('gather_bw', 0) / 1e12:.2f} TB/s written. Cluster/DSM: the "
             "CUDA cluster kernel where its shape limits allow, as speed-up over our best plan's time "
             "(>1 means the cluster kernel is faster).", ""]
    lines += table_lines(rows)
    measured = {r["case"] for r in rows}
    old = [r for r in earlier["rows"] if r["case"] not in measured] if earlier else []
    lines += ["", _checks_line(checks, earlier), "", f"Issue 7's device criteria over the {len(rows)} shapes of this "
              f"run{f' and the {len(old)} shapes of the earlier run below' if old else ''}:", ""]
    lines += acceptance_lines(rows, old) + [""]
    if earlier:
        lines += _earlier_dsm_lines(rows, earlier)
        if old:
            lines += [f"Shapes not measured in this run, from an earlier run ({_run_description(earlier['meta'])}):",
                      ""]
            lines += table_lines(old) + [""]
    return "\n".join(lines)


def _run_description(meta: dict) -> str:
    """How an earlier run measured, from its own record."""
    timing = meta.get("timing", {})
    how = ("CUDA-graph replays" if timing.get("graph") else "plain calls, no CUDA graph (launch noise in the "
           "candidate columns)")
    flush = meta.get("flush", "L2 zeroed between timings (triton.testing.do_bench; before the clean flush)")
    return (f"{meta['date']}, {meta['device']}, `{meta['command']}`; copy {meta['copy_bw'] / 1e12:.2f} TB/s, GEMM "
            f"{meta['gemm_flops'] / 1e12:.0f} TFLOP/s; {how}; {flush}")


def update_benchmarks_md(path: Path, section: str) -> None:
    """Replace (or append) only this suite's section of BENCHMARKS.md."""
    replace_section(path, SECTION, section)


def _checks_line(checks: list[dict], earlier: dict | None) -> str:
    if not checks:
        old = earlier["checks"] if earlier else []
        return ("Device correctness checks: not run in this run (each timed winner was checked against eager)"
                + (f"; the earlier run: {sum(c['ok'] for c in old)}/{len(old)} passed." if old else "."))
    failed = ", ".join(c["check"] + " " + format(c["rel_err"], ".1e") for c in checks if not c["ok"])
    return f"Device correctness checks: {sum(c['ok'] for c in checks)}/{len(checks)} passed ({failed or 'all'})."


def _earlier_dsm_lines(rows: list[dict], earlier: dict) -> list[str]:
    """The cluster kernel's comparison from the earlier run for shapes whose row here has none."""
    mine = {r["case"] for r in rows if _best_dsm(r) is None}
    found = [(r, _best_dsm(r)) for r in earlier["rows"] if r["case"] in mine and _best_dsm(r)]
    if not found:
        return []
    items = "; ".join(f"{r['case']}: {_us(d['seconds'])} µs (C{d['cluster']}) against our best plan then, "
                      f"{_us(r['ours_kernel_s'])} µs, {r['ours_kernel_s'] / d['seconds']:.2f}×" for r, d in found)
    timing = "CUDA-graph replays" if earlier["meta"].get("timing", {}).get("graph") else "plain calls"
    return [f"Cluster/DSM kernel on shapes of this run, as measured in the earlier run ({earlier['meta']['date']}, "
            f"{earlier['meta']['device']}, {timing}; not rebuilt in this run): {items}.", ""]


def rewrite_section(run_dir: str, earlier: str | None, benchmarks_md: str | None) -> str:
    """The section again from a run's chains.json (e.g. fetched from the device), with the
    cases of an earlier run that this one did not measure."""
    data = json.loads((Path(run_dir) / "chains.json").read_text())
    old = json.loads(Path(earlier).read_text()) if earlier else None
    section = section_text(data["meta"], data["rows"], data["checks"], old)
    if benchmarks_md:
        update_benchmarks_md(Path(benchmarks_md), section)
    return section
