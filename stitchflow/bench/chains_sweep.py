"""Exploratory sweep for the chain kernels: many tile configurations per shape, timed in one process.

    PYTHONPATH=. python3 -m stitchflow.bench.chains_sweep --out results/ [--workers 12]

Configurations are compiled first by a pool of worker processes (each runs every configuration
of its share once, which fills Triton's on-disk cache), then timed one after another in this
process, so the device time goes to timing rather than to compiling. Every configuration is
checked against torch on the same inputs before it is timed. Writes sweep.json under --out and
prints one line per configuration; the data calibrate chain_cost's device constants.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import torch
import torch.nn.functional as F

DEVICE = "cuda"

# problem name -> (M, K, N, L, act, gated)
PROBLEMS = {
    "mb64": (65536, 64, 256, 64, "gelu", False),
    "mb128": (16384, 128, 512, 128, "gelu", False),
    "conv": (8 * 56 * 56, 576, 256, 64, "gelu", False),
    "gpt128": (128, 4096, 16384, 4096, "gelu", False),
    "gpt32": (32, 4096, 16384, 4096, "gelu", False),
    "gpt2048": (2048, 4096, 16384, 4096, "gelu", False),
    "swiglu16": (16, 4096, 14336, 4096, "silu", True),
}


def jobs() -> list[tuple]:
    """(problem, kind, config): kind in resident, chain, gemm1, gemm2, gemm1_tma, gemm2_tma, torch."""
    return _memory_bound_jobs()


def _memory_bound_jobs() -> list[tuple]:
    out = []
    for prob in ("mb64", "mb128"):
        for bn in (64, 128):
            out.append((prob, "resident", dict(bm=256, bn=bn, num_warps=8, programs_per_sm=1)))
        for bm, bn, warps in ((64, 64, 4), (64, 128, 4), (128, 64, 8), (128, 128, 8), (128, 64, 4)):
            for stages in (2, 3):
                out.append((prob, "resident", dict(bm=bm, bn=bn, num_warps=warps, num_stages=stages, flatten=True,
                                                   prefetch=False, programs_per_sm=1)))
    for bm, warps in ((64, 4), (64, 8), (128, 8), (128, 4)):
        for stages in (1, 2, 3):
            for per_sm in (1, 2):
                out.append(("mb64", "resident", dict(bm=bm, num_warps=warps, num_stages=stages, transposed=True,
                                                     programs_per_sm=per_sm)))
    out.append(("mb64", "resident", dict(bm=64, num_warps=4, num_stages=2, transposed=True, act="none")))
    out.append(("mb64", "resident", dict(bm=128, num_warps=8, num_stages=2, transposed=True, act="none")))
    for bm, bn, warps, stages in ((64, 256, 4, 3), (64, 256, 8, 3), (128, 256, 8, 3), (64, 128, 4, 4)):
        out.append(("conv", "chain", dict(bm=bm, bn=bn, bk=64, bl=64, num_warps=warps, num_stages=stages)))
    return out


def _weight_stream_jobs() -> list[tuple]:
    out = []
    for prob in ("gpt128",):
        for bm, bn, bk, warps, stages in ((128, 128, 64, 8, 5), (64, 128, 64, 4, 5), (128, 64, 64, 4, 8)):
            out.append((prob, "gemm1", dict(bm=bm, bn=bn, bk=bk, num_warps=warps, num_stages=stages)))
        for bm, bn, bk, split, warps, stages in ((128, 64, 128, 2, 8, 4), (128, 128, 64, 2, 8, 5),
                                                 (64, 64, 128, 2, 4, 4)):
            out.append((prob, "gemm2", dict(bm=bm, bn=bn, bk=bk, split_k=split, num_warps=warps, num_stages=stages)))
    return out


# ---------------------------------------------------------------- problems and runners

def make_problem(name: str) -> dict:
    M, K, N, L, act, gated = PROBLEMS[name]
    g = torch.Generator(device=DEVICE).manual_seed(sum(map(ord, name)))
    r = lambda *s, scale=1.0: (torch.randn(s, device=DEVICE, generator=g) * scale).to(torch.bfloat16)
    p = {"a": r(M, K), "b": r(K, N, scale=K ** -0.5), "d": r(N, L, scale=N ** -0.5), "act": act}
    p["bu"] = r(K, N, scale=K ** -0.5) if gated else None
    fn = F.gelu if act == "gelu" else F.silu
    h = fn(p["a"] @ p["b"])
    if gated:
        h = h * (p["a"] @ p["bu"])
    p["h"] = h
    p["ref"] = h @ p["d"]
    return p


def runner(kind: str, cfg: dict, p: dict):
    """(callable, reference) for one configuration."""
    from stitchflow.targets.gpu import chain_kernels as ck
    from stitchflow.targets.gpu.chain_resident import ResidentTiles, resident_chain
    from stitchflow.targets.gpu.gemm_tma import gemm_tma

    a, b, bu, d = p["a"], p["b"], p["bu"], p["d"]
    cfg = dict(cfg)
    if kind == "resident":
        act = cfg.pop("act", p["act"])
        tiles = ResidentTiles(**cfg)
        ref = p["ref"] if act.startswith(p["act"]) else None
        return (lambda: resident_chain(a, b, d, act=act, bu=bu, tiles=tiles)[0]), ref
    if kind == "chain":
        act = cfg.pop("act", p["act"])
        tiles = ck.ChainTiles(**cfg)
        return (lambda: ck.chain(a, b, d, act=act, bu=bu, tiles=tiles)[0]), p["ref"] if act.startswith(p["act"]) else None
    if kind.startswith("gemm1"):
        tiles = ck.GemmTiles(**cfg)
        fn = gemm_tma if kind.endswith("tma") else ck.gemm
        return (lambda: fn(a, b, bu=bu, epi=ck.Epilogue(act=p["act"]), tiles=tiles)[0]), p["h"]
    if kind.startswith("gemm2"):
        tiles = ck.GemmTiles(**cfg)
        fn = gemm_tma if kind.endswith("tma") else ck.gemm
        h = p["h"]
        return (lambda: fn(h, d, tiles=tiles)[0]), p["ref"]
    raise ValueError(kind)


def _compile_share(share: list[tuple]) -> list[str]:
    """Worker: run each configuration once (fills the on-disk kernel cache); report failures."""
    problems, failures = {}, []
    for prob, kind, cfg in share:
        if kind == "torch":
            continue
        try:
            if prob not in problems:
                problems[prob] = make_problem(prob)
            fn, _ = runner(kind, cfg, problems[prob])
            fn()
            torch.cuda.synchronize()
        except Exception as err:
            failures.append(f"{prob} {kind} {cfg}: {type(err).__name__}: {str(err)[:200]}")
    return failures


def precompile(all_jobs: list[tuple], workers: int) -> list[str]:
    if workers <= 1:
        return _compile_share(all_jobs)
    shares = [all_jobs[i::workers] for i in range(workers)]
    try:  # a crashed worker breaks the pool (rather than hanging it): the timing pass then compiles
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            return [f for part in pool.map(_compile_share, shares) for f in part]
    except BrokenProcessPool as err:
        return [f"precompile pool broke: {err}"]


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=30, return_mode="median") * 1e-3


def rel_err(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def torch_times(p: dict) -> dict:
    a, b, bu, d = p["a"], p["b"], p["bu"], p["d"]
    act = F.gelu if p["act"] == "gelu" else F.silu
    h = p["h"]
    out = {"mm1_s": bench(lambda: a @ b), "mm2_s": bench(lambda: h @ d), "act_s": bench(lambda: act(h))}
    if bu is not None:
        out["eager_s"] = bench(lambda: (act(a @ b) * (a @ bu)) @ d)
    else:
        out["eager_s"] = bench(lambda: act(a @ b) @ d)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out/sweep")
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--only", default=None, help="comma-separated problems")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = [j for j in jobs() if not args.only or j[0] in args.only.split(",")]
    start = time.time()
    failures = precompile(todo, args.workers)
    print(f"compiled {len(todo)} configurations in {time.time() - start:.0f}s; {len(failures)} failed", flush=True)
    for f in failures:
        print("  compile failure:", f, flush=True)
    src = torch.randn(1 << 28, device=DEVICE)
    dst = torch.empty_like(src)
    ceil = {"copy_bw": 2 * src.numel() * 4 / bench(lambda: dst.copy_(src))}
    x = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    ceil["gemm_flops"] = 2 * 8192 ** 3 / bench(lambda: x @ x)
    del src, dst, x
    print(f"ceilings: copy {ceil['copy_bw'] / 1e12:.2f} TB/s, gemm {ceil['gemm_flops'] / 1e12:.0f} TFLOP/s", flush=True)
    rows, problems = [], {}
    for prob, kind, cfg in todo:
        if prob not in problems:
            problems.clear()
            torch.cuda.empty_cache()
            problems[prob] = make_problem(prob)
        p = problems[prob]
        row = {"problem": prob, "kind": kind, "cfg": cfg}
        try:
            if kind == "torch":
                row.update(torch_times(p))
            else:
                fn, ref = runner(kind, cfg, p)
                row["err"] = rel_err(fn(), ref) if ref is not None else None
                row["seconds"] = bench(fn)
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        rows.append(row)
        show = {k: (f"{v * 1e6:.1f}us" if k.endswith("s") and isinstance(v, float) else v) for k, v in row.items()
                if k not in ("problem", "kind", "cfg")}
        print(f"{prob:9s} {kind:10s} {json.dumps(cfg)} {show}", flush=True)
        (out / "sweep.json").write_text(json.dumps({"ceilings": ceil, "rows": rows, "failures": failures}, indent=1))
    print(f"total {time.time() - start:.0f}s")
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
