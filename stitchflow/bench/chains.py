"""`stitchflow bench chains`: compute chains E = act(A·B)·D on the GPU, every competitor in one process.

    PYTHONPATH=. python3 -m stitchflow.bench.chains --out results/ [--budget 400] [--quick]

Competitors on the same inputs: eager (cuBLAS + a separate activation), torch.compile (default,
and max-autotune-no-cudagraphs on the shapes the time budget allows), ours (the cost model's
shortlist timed on the device, the winner kept), and the cluster/DSM kernel where its shape
limits allow. Floors: bytes at the measured copy bandwidth and FLOPs at the measured bf16 GEMM
rate, both measured in this run. Every result is checked against eager before it is timed.
Writes chains.json, chains.csv and chains_section.md (the BENCHMARKS.md section) under --out.
"""

from __future__ import annotations

from .chains_checks import device_checks, dsm_check, rel_err, stream_checks, wgmma_checks
from .chains_report import acceptance_lines  # noqa: F401 (re-exported: tests and scripts import it from here)
from .chains_report import _us, rewrite_section, section_text, table_lines, update_benchmarks_md
from .report import write_results

import argparse
import datetime
import json
import math
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

DEVICE = "cuda"  # the smoke test in tests/ runs the suite on the CPU under the interpreter


@dataclass(frozen=True)
class ChainCase:
    name: str
    M: int
    K: int
    N: int
    L: int
    act: str = "gelu"
    gated: bool = False
    conv: tuple | None = None      # (batch, channels, height, width): A is im2col of a 3x3 conv input
    max_autotune: bool = False     # worth the compile time of mode="max-autotune-no-cudagraphs"


def default_cases() -> list[ChainCase]:
    """Round two's open cases first (swiglu prefill, conv), so a run cut short by its time
    budget still measures them."""
    cases = [ChainCase("swiglu prefill M=4096", 4096, 4096, 14336, 4096, act="silu", gated=True),
             ChainCase("conv3x3 64-256 gelu conv1x1 -64, 8x56x56", 8 * 56 * 56, 64 * 9, 256, 64,
                       conv=(8, 64, 56, 56)),
             ChainCase("membound 65536x64-256-64", 65536, 64, 256, 64, max_autotune=True),
             ChainCase("membound 16384x128-512-128", 16384, 128, 512, 128, max_autotune=True)]
    for m in (32, 128, 512, 2048, 4096):
        cases.append(ChainCase(f"gpt6.7b ffn M={m}", m, 4096, 16384, 4096, max_autotune=m == 128))
    cases.append(ChainCase("swiglu decode M=16", 16, 4096, 14336, 4096, act="silu", gated=True))
    return cases


# ---------------------------------------------------------------- ceilings and timing

TIMING = {"graph": 0, "plain": 0}  # how many measurements were graph replays / plain calls


def bench(fn) -> float:
    """Every competitor is timed the same way: median of CUDA-graph replays (chains.graph_bench)."""
    from stitchflow.targets.gpu.timing import graph_bench

    seconds, how = graph_bench(fn)
    TIMING[how] += 1
    return seconds


def measure_ceilings() -> dict:
    """Device-to-device copy (bytes read + written) and an 8192³ bf16 GEMM on random data; then
    the cost model's calibration probes (chain_cost.DeviceProfile), on shapes of their own."""
    from triton.testing import do_bench

    from .stitching import copy_bandwidth

    # A plain launch, L2 evicted clean before each copy (as the stitching bench measures it): captured in a
    # CUDA graph, the copy_ read 2.76 TB/s (H200, round two) against 4.25 as a plain launch, likely a memcpy
    # node on the copy engines instead of a kernel.
    copy_bw = copy_bandwidth(torch.device(DEVICE))
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    gemm_s = do_bench(lambda: a @ b, warmup=10, rep=50, return_mode="median") * 1e-3
    ceilings = {"copy_bw": copy_bw, "gemm_flops": 2 * 8192 ** 3 / gemm_s}
    return {**ceilings, "probes": calibration_probes(ceilings, a, b)}


def calibration_probes(ceilings: dict, a, b) -> dict:
    """Our Triton GEMM on 8192³ (128×128×64 tiles, 8 warps) against cuBLAS; a 16-row GEMM over an
    8192² weight (weight streaming) through Triton and cuBLAS against the copy rate; the im2col
    gather of a 4×32×64×64 input. None of these is a benchmark case."""
    from stitchflow.targets.gpu import chain_kernels as ck
    from stitchflow.targets.gpu.chains import im2col_nhwc

    tri_s = bench(lambda: ck.gemm(a, b, tiles=ck.GemmTiles(128, 128, 64, 1, 8, 8, 3)))
    x16 = a[:16].contiguous()
    weight_bytes = b.numel() * b.element_size()
    tri_stream_s = bench(lambda: ck.gemm(x16, b, tiles=ck.GemmTiles(16, 64, 128, 1, 8, 4, 4)))
    lib_stream_s = bench(lambda: x16 @ b)
    x = torch.randn(4, 32, 64, 64, device=DEVICE).to(torch.bfloat16)
    gather_s = bench(lambda: im2col_nhwc(x, 3, 3, 1))
    from stitchflow.targets.gpu.chain_wgmma import gluon_refusal

    gluon = {}
    if torch.cuda.get_device_capability()[0] == 9 and gluon_refusal() is None:
        from stitchflow.targets.gpu.stream_gemm import StreamTiles, stream_gemm

        gluon_s = bench(lambda: stream_gemm(x16, b, tiles=StreamTiles(64, 64, 128, 6, 1, 4)))
        gluon["gluon_stream_eff"] = weight_bytes / gluon_s / ceilings["copy_bw"]
    return {**gluon, "triton_mma_eff": 2 * 8192 ** 3 / tri_s / ceilings["gemm_flops"],
            "triton_stream_eff": weight_bytes / tri_stream_s / ceilings["copy_bw"],
            "library_stream_eff": weight_bytes / lib_stream_s / ceilings["copy_bw"],
            "gather_bw": 4 * 64 * 64 * 9 * 32 * 2 / gather_s}


# ---------------------------------------------------------------- problems and competitors

def _rand(shape, scale=1.0, gen=None):
    return (torch.randn(shape, device=DEVICE, generator=gen) * scale).to(torch.bfloat16)


def make_problem(case: ChainCase, gen) -> dict:
    p = {"b": _rand((case.K, case.N), case.K ** -0.5, gen), "d": _rand((case.N, case.L), case.N ** -0.5, gen)}
    if case.gated:
        p["bu"] = _rand((case.K, case.N), case.K ** -0.5, gen)
    if case.conv:  # b's rows are (c, kh, kw): eager's conv weight is b.t() as [N, cin, 3, 3]
        p["x"] = _rand(case.conv, 1.0, gen)
    else:
        p["a"] = _rand((case.M, case.K), 1.0, gen)
    return p


def eager_fn(case: ChainCase):
    act = F.gelu if case.act == "gelu" else F.silu
    if case.conv:
        batch, cin, hgt, wid = case.conv
        def conv_chain(x, b, d):  # conv weights as the chain's matrices: w1 [N, cin, 3, 3], w2 [L, N, 1, 1]
            w1 = b.t().reshape(case.N, cin, 3, 3)
            w2 = d.t().reshape(case.L, case.N, 1, 1)
            return F.conv2d(act(F.conv2d(x, w1, padding=1)), w2)
        return conv_chain
    if case.gated:
        return lambda a, b, bu, d: (act(a @ b) * (a @ bu)) @ d
    return lambda a, b, d: act(a @ b) @ d


def args_of(case: ChainCase, p: dict) -> tuple:
    if case.conv:
        return p["x"], p["b"], p["d"]
    return (p["a"], p["b"], p["bu"], p["d"]) if case.gated else (p["a"], p["b"], p["d"])


def ours_operands(case: ChainCase, p: dict):
    """The conv case hands over the conv input: plans build im2col (or run cuDNN) inside each call."""
    from stitchflow.targets.gpu.chains import Operands, conv_operands

    if case.conv:
        w1 = p["b"].t().reshape(case.N, case.conv[1], 3, 3)
        return conv_operands(p["x"], w1, p["d"], padding=1, act=case.act)
    return Operands(a=p["a"], b=p["b"], d=p["d"], bu=p.get("bu"), act=case.act)


def ours_fn(case: ChainCase, plan, p: dict):
    from stitchflow.targets.gpu.chains import run_plan

    ops = ours_operands(case, p)
    if not case.conv:
        return lambda: run_plan(plan, ops)
    batch, cin, hgt, wid = case.conv
    # E's rows are (b, h, w): a channels-last view of the NCHW result, no copy
    return lambda: run_plan(plan, ops).reshape(batch, hgt, wid, case.L).permute(0, 3, 1, 2)


def floors(case: ChainCase, ceilings: dict) -> dict:
    from stitchflow.targets.gpu.chain_cost import ChainShape

    shape = ChainShape(case.M, case.K, case.N, case.L, 2, case.gated, case.act)  # floors: no conv_in (im2col-free)
    io = shape.io_bytes
    if case.conv:  # the conv input is read once, not its 9x im2col
        io += (math.prod(case.conv) - case.M * case.K) * 2
    return {"bytes": io, "flops": shape.flops, "hbm_floor": io / ceilings["copy_bw"],
            "flop_floor": shape.flops / ceilings["gemm_flops"]}


# ---------------------------------------------------------------- one case

class Budget:
    def __init__(self, seconds: float):
        self.end = time.time() + seconds

    def left(self) -> float:
        return self.end - time.time()


def _compiled_fn(fn, args, ref, mode, budget: Budget, need: float):
    """(torch.compile'd callable or None, note)."""
    if budget.left() < need:
        return None, "skipped (time budget)"
    try:
        torch._dynamo.reset()
        compiled = torch.compile(fn, dynamic=False, mode=mode)
        start = time.time()
        out = compiled(*args)
        compile_s = time.time() - start
        return (lambda: compiled(*args)), f"compile {compile_s:.0f}s err {rel_err(out, ref):.1e}"
    except Exception as err:  # report, do not stop the run
        return None, f"failed: {type(err).__name__}: {str(err)[:120]}"


def _compiled_time(fn, args, ref, mode, budget: Budget, need: float):
    call, note = _compiled_fn(fn, args, ref, mode, budget, need)
    return (bench(call) if call else None), note


def interleaved(fns: dict, rounds: int = 3) -> dict:
    """Each competitor's median over `rounds`, timed in turn (A B C A B C ...): on the H100 the clock
    drifts by about 5% over a minute of large GEMMs (torch.compile's FFN at M=4096 read 1499 µs in one
    run and 1579 µs in the next), so timing one competitor after the other confounds drift with speed."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(bench(fn))
    return {name: statistics.median(v) for name, v in times.items()}


def run_case(case: ChainCase, p: dict, ceilings: dict, profile, budget: Budget, dsm_ready, top_k: int) -> dict:
    from stitchflow.targets.gpu import cluster_dsm
    from stitchflow.targets.gpu.chains import autotune

    row = {"case": case.name, "M": case.M, "K": case.K, "N": case.N, "L": case.L, **floors(case, ceilings)}
    eager, args = eager_fn(case), args_of(case, p)
    ref = eager(*args)
    ops = ours_operands(case, p)
    best, report = autotune(ops, k=top_k, profile=profile, use_cache=False)
    ours = ours_fn(case, best, p)
    row["ours_err"] = rel_err(ours(), ref)
    row["ours_ok"] = row["ours_err"] < 2e-2
    row.update(plan=str(best), model_first=report["first_choice"], model_first_s=report["first_choice_seconds"],
               best_profiled_s=report["seconds"], timed=report["timed"])
    compiled, row["compile_note"] = _compiled_fn(eager, args, ref, None, budget, 30)
    final = interleaved({"eager_s": lambda: eager(*args), "ours_s": ours, **({"compile_s": compiled} if compiled else {})})
    row["compile_s"] = None  # stays None when torch.compile failed or was skipped
    row.update(final)
    row["max_autotune_s"], row["max_autotune_note"] = None, "not run for this shape (compile time)"
    # Our best plan as the autotuner timed it (the conv case: im2col or cuDNN included), the
    # baseline the cluster kernel is compared with; the cluster kernel builds im2col in its call too.
    row["ours_kernel_s"] = report["seconds"]
    row["dsm"] = []
    ref2d = ref.permute(0, 2, 3, 1).reshape(case.M, case.L) if case.conv else ref
    if dsm_ready() and not case.gated:
        for size in cluster_dsm.CLUSTER_SIZES:
            if cluster_dsm.supports(case.M, case.N, case.K, case.L, size, case.act, torch.bfloat16):
                def fn(s=size):
                    m = ops.with_matrix_a()
                    return cluster_dsm.dsm_chain(m.a, m.b, m.d, act=case.act, cluster=s)
                try:
                    row["dsm"].append({"cluster": size, "err": rel_err(fn(), ref2d), "seconds": bench(fn)})
                except Exception as err:  # report, do not stop the run
                    row["dsm"].append({"cluster": size, "error": f"{type(err).__name__}: {str(err)[:160]}"})
    return row


# ---------------------------------------------------------------- compiling the shortlists in parallel

def _warm_case(job) -> list[str]:
    """Worker: run every shortlisted plan of one case once, so its kernels land in Triton's disk
    cache and the timing process only loads them. Returns failures (reported, not fatal)."""
    case, ceilings, device_name, top_k = job
    from stitchflow.targets.gpu import chain_cost, chain_plans
    from stitchflow.targets.gpu.chains import run_plan

    gen = torch.Generator(device=DEVICE).manual_seed(1)
    p = make_problem(case, gen)
    ops = ours_operands(case, p)
    profile = chain_cost.profile_for(device_name, ceilings["copy_bw"], ceilings["gemm_flops"], ceilings["probes"])
    failures = []
    for plan in chain_plans.shortlist(ops.shape(), profile, top_k):
        try:
            run_plan(plan, ops)
            torch.cuda.synchronize()
        except Exception as err:
            failures.append(f"{case.name}: {plan}: {type(err).__name__}: {str(err)[:120]}")
    try:  # fills Inductor's on-disk caches: the timing process's torch.compile then mostly loads
        torch.compile(eager_fn(case), dynamic=False)(*args_of(case, p))
        torch.cuda.synchronize()
    except Exception as err:
        failures.append(f"{case.name}: torch.compile: {type(err).__name__}: {str(err)[:120]}")
    return failures


def _pool_job(job):
    """A shortlist to compile, or one dtype's device checks (they compile dozens of kernels:
    run beside the shortlists, while nothing is being timed)."""
    if job[0] == "checks":
        return "checks", device_checks((job[1],))
    return "failures", _warm_case(job)


def precompile(cases, ceilings: dict, top_k: int, checks: bool, workers: int = 12) -> tuple[list[str], list[dict]]:
    """(compile failures, device check results)."""
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool
    import multiprocessing as mp

    jobs = [("checks", dt) for dt in ((torch.float32, torch.bfloat16) if checks else ())]
    jobs += [(c, ceilings, torch.cuda.get_device_name(), top_k) for c in cases]
    failures, results = [], []
    try:
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=mp.get_context("spawn")) as pool:
            for what, part in pool.map(_pool_job, jobs):
                (results if what == "checks" else failures).extend(part)
    except BrokenProcessPool as err:  # the timing pass then compiles what is missing
        failures.append(f"precompile pool broke: {err}")
    return failures, results


# ---------------------------------------------------------------- the whole run

def _max_autotune_pass(cases, rows, weights, budget: Budget, gen) -> None:
    """max-autotune compiles for minutes: run it last, on the flagged shapes, while time is left."""
    by_name = {r["case"]: r for r in rows}
    for case in cases:
        row = by_name.get(case.name)
        if row is None or not case.max_autotune:
            continue
        p = make_problem(case, gen)
        eager, args = eager_fn(case), args_of(case, p)
        row["max_autotune_s"], row["max_autotune_note"] = _compiled_time(
            eager, args, eager(*args), "max-autotune-no-cudagraphs", budget, 60)
        print(f"{case.name}: max-autotune {_us(row['max_autotune_s'])} {row['max_autotune_note']}", flush=True)


def run(shapes=None, out_dir="bench_out", budget_s: float = 420.0, top_k: int = 8, checks: bool = True,
        benchmarks_md: str | None = None, command: str = "python -m stitchflow.bench.chains",
        max_autotune: bool = True, pool: bool = True, dsm: bool = True) -> list[dict]:
    """pool: compile shortlists and run the checks in worker processes first (worth it when the
    caches are warm or the budget is long; a cold start of twelve workers took over two minutes)."""
    import triton

    from stitchflow.targets.gpu import cluster_dsm
    from stitchflow.targets.gpu.chain_cost import profile_for

    budget = Budget(budget_s)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build = {"error": None}

    def build_dsm():  # nvcc runs while the Triton work goes on
        try:
            cluster_dsm.load_extension()
        except Exception as err:
            build["error"] = f"{type(err).__name__}: {str(err)[-400:]}"

    builder = threading.Thread(target=build_dsm if dsm else lambda: build.update(error="not built (--no-dsm)"),
                               daemon=True)
    builder.start()
    ceilings = measure_ceilings()
    profile = profile_for(torch.cuda.get_device_name(), ceilings["copy_bw"], ceilings["gemm_flops"], ceilings["probes"])
    print("calibration probes:", {k: round(v, 3) if v < 10 else f"{v:.3g}" for k, v in ceilings["probes"].items()},
          flush=True)
    started = time.time()
    if pool:
        failures, results = precompile(shapes or default_cases(), ceilings, top_k, checks)
    else:
        failures, results = [], device_checks() if checks else []
    for failure in failures:
        print("precompile:", failure, flush=True)
    print(f"shortlists compiled, device checks run in {time.time() - started:.0f}s", flush=True)
    builder.join(timeout=min(240.0, max(5.0, budget.left() - 120)))  # nvcc: wait only while time is left
    dsm_ok = not builder.is_alive() and build["error"] is None
    if checks:
        results += wgmma_checks()
        results += stream_checks()
    if checks and dsm_ok:
        try:
            results += dsm_check()
        except Exception as err:
            results.append({"check": "dsm", "rel_err": float("nan"), "ok": False, "error": str(err)[:300]})
    for c in results:
        print(f"check {c['check']}: rel err {c['rel_err']:.2e} {'ok' if c['ok'] else 'FAIL'}", flush=True)
    meta = {"command": command, "device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "triton": triton.__version__, "dsm_build": build["error"] or "ok",
            "flush": "L2 evicted clean (256 MB read) before each timing", **ceilings}
    rows, weights = [], {}
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for case in shapes or default_cases():
        if budget.left() < 20:
            print(f"skip {case.name}: time budget", flush=True)
            continue
        key = (case.K, case.N, case.L, case.gated, case.conv)
        if key not in weights:  # the M sweep shares one set of weights
            weights.clear()
            weights[key] = make_problem(case, gen)
        p = dict(weights[key])
        if not case.conv:
            p["a"] = _rand((case.M, case.K), 1.0, gen)
        start = time.time()
        try:
            row = run_case(case, p, ceilings, profile, budget, lambda: dsm_ok, top_k)
        except Exception as err:
            print(f"case {case.name} failed: {type(err).__name__}: {err}", flush=True)
            continue
        row["wall_s"] = time.time() - start
        rows.append(row)
        print(f"{case.name}: eager {_us(row['eager_s'])} compile {_us(row.get('compile_s'))} ours "
              f"{_us(row['ours_s'])} ({row['plan']}) err {row['ours_err']:.1e} [{row['wall_s']:.0f}s]", flush=True)
        (out / "chains.json").write_text(json.dumps({"meta": meta, "checks": results, "rows": rows}, indent=1))
    if max_autotune:
        _max_autotune_pass(shapes or default_cases(), rows, weights, budget, gen)
    meta["timing"] = dict(TIMING)
    meta["probes"] = ceilings["probes"]
    fields = ["case", "M", "K", "N", "L", "hbm_floor", "flop_floor", "eager_s", "compile_s", "max_autotune_s",
              "ours_s", "ours_kernel_s", "ours_err", "plan", "model_first_s", "best_profiled_s"]
    write_results(out, "chains", {"meta": meta, "checks": results, "rows": rows}, rows, fields)
    section = section_text(meta, rows, results)
    (out / "chains_section.md").write_text(section)
    if benchmarks_md:
        update_benchmarks_md(Path(benchmarks_md), section)
    print("\n".join(table_lines(rows)))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="stitchflow bench chains", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out/chains", help="folder for chains.json, .csv and the md section")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds; later competitors are skipped past it")
    parser.add_argument("--top-k", type=int, default=8, help="plans from the cost model timed per shape")
    parser.add_argument("--quick", action="store_true", help="the two memory-bound shapes and GPT M=128 only")
    parser.add_argument("--no-checks", action="store_true")
    parser.add_argument("--no-max-autotune", action="store_true", help="skip the max-autotune column (minutes)")
    parser.add_argument("--benchmarks-md", default=None, help="update this BENCHMARKS.md's section")
    parser.add_argument("--cases", default="", help="comma-separated name prefixes: only these cases")
    parser.add_argument("--no-pool", action="store_true", help="compile in the timing process (cold machines)")
    parser.add_argument("--no-dsm", action="store_true", help="do not build or time the cluster kernel")
    parser.add_argument("--section-from", default=None, help="only rewrite the section from DIR/chains.json")
    parser.add_argument("--earlier", default=None, help="with --section-from: an older chains.json for missing cases")
    args = parser.parse_args(argv)
    if args.section_from:
        print(rewrite_section(args.section_from, args.earlier, args.benchmarks_md))
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("stitchflow bench chains needs a CUDA GPU")
    cases = default_cases()
    if args.quick:
        cases = [c for c in cases if c.max_autotune]
    if args.cases:
        cases = [c for c in cases if any(c.name.startswith(p) for p in args.cases.split(","))]
    cmd = "python -m stitchflow.bench.chains " + " ".join(argv or [])
    run(cases, args.out, args.budget, args.top_k, not args.no_checks, args.benchmarks_md, cmd.strip(),
        not args.no_max_autotune, not args.no_pool, not args.no_dsm)
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
