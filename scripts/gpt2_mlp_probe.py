"""Device probe: GPT-2's MLP as transformers writes it (Conv1D's flattened rows around addmm, NewGELU written out)
with and without the two rewrites that make it one GEMM → GELU → GEMM chain (ir/reshapes.py, ir/activations.py),
against eager and torch.compile; then whole HF models under torch.compile(backend="stitchflow") both ways.

    PYTHONPATH=. python scripts/gpt2_mlp_probe.py [--rows 4096] [--models hf-gpt2,hf-opt] [--model-size default]
"""
import argparse
import statistics

import torch

import stitchflow
from stitchflow.bench.stitching import _time_in_rounds
from stitchflow.bench.stitching_patterns import as_tuple, relative_error
from stitchflow.targets.gpu.timing import graph_bench

AS_WRITTEN = {"unflatten_rows": False, "recognise_activations": False}


def chain_plans(prog) -> list[str]:
    return [str(p) for run in prog.compiled for s in getattr(run, "steps", ())
            if isinstance(getattr(s, "plans", None), dict) for p in s.plans.values()]


def mlp_rows(rows: int) -> None:
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    config = GPT2Config(resid_pdrop=0.0)
    torch.manual_seed(0)
    mlp = GPT2MLP(4 * config.n_embd, config).to("cuda", torch.bfloat16).eval()
    x = torch.randn(rows // 1024, 1024, config.n_embd, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = mlp(x)
        times = {"eager": graph_bench(lambda: mlp(x))[0] * 1e6}
        compiled = torch.compile(mlp)
        compiled(x)
        times["torch.compile"] = graph_bench(lambda: compiled(x))[0] * 1e6
        for label, options in (("stitchflow", {}), ("stitchflow as written", AS_WRITTEN)):
            prog = stitchflow.compile(mlp, (x,), target="gpu", fusion="auto", options=options)
            err = relative_error(prog(x), ref)
            times[label] = graph_bench(lambda: prog(x))[0] * 1e6
            print(f"{label}: rel err {err:.1e}, chain plans {chain_plans(prog)}", flush=True)
    tc = times["torch.compile"]
    for label, t in times.items():
        print(f"MLP {rows}x768-3072-768 bf16 {label}: {t:.1f} us ({tc / t:.2f}x torch.compile)", flush=True)


def whole_model(name: str, size: str) -> None:
    from stitchflow.apps import build_model

    torch._dynamo.reset()
    model, inputs = build_model(name, size=size, dtype=torch.bfloat16)
    model = model.cuda()
    inputs = tuple(x.cuda() if isinstance(x, torch.Tensor) else x for x in inputs)
    with torch.no_grad():
        ref = as_tuple(model(*inputs))[0]
        runners = {"eager": lambda: model, "torch.compile": lambda: torch.compile(model, dynamic=False),
                   "stitchflow": lambda: torch.compile(model, backend="stitchflow", dynamic=False,
                                                       options={"autotune": "all"}),
                   "stitchflow as written": lambda: torch.compile(model, backend="stitchflow", dynamic=False,
                                                                  options={"autotune": "all", **AS_WRITTEN})}
        ready = {}
        for label, make in runners.items():
            fn = make()
            print(f"{name} {label}: rel err {relative_error(as_tuple(fn(*inputs))[0], ref):.3g}", flush=True)
            ready[label] = fn
        times = {k: statistics.median(v) for k, v in _time_in_rounds(ready, [inputs]).items()}
    for label, t in times.items():
        print(f"{name} {size} bf16 {label}: {t:.1f} us ({times['torch.compile'] / t:.2f}x torch.compile)", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--models", default="hf-gpt2", help="comma-separated HF models of the zoo; '' for none")
    ap.add_argument("--model-size", default="default")
    ap.add_argument("--skip-mlp", action="store_true")
    args = ap.parse_args()
    if not args.skip_mlp:
        mlp_rows(args.rows)
    for name in filter(None, args.models.split(",")):
        whole_model(name, args.model_size)


if __name__ == "__main__":
    main()
