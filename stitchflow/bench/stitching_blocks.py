"""Transformer blocks end to end on the GPU (issue 6's last acceptance point): the BERT-style
encoder block and the Llama-style block, eager vs torch.compile (default mode) vs
torch.compile(backend="stitchflow") vs stitchflow.compile(target="gpu", fusion="auto").
GEMMs run through torch in stitchflow for now; everything between them is generated.

    python -m stitchflow.bench.stitching_blocks [--apps bert,llama] [--dtype bfloat16] [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch

from .stitching_patterns import as_tuple, relative_error


def _time(fn, inputs) -> float:
    from triton.testing import do_bench

    return do_bench(lambda: fn(*inputs), warmup=10, rep=60, return_mode="median") * 1e3  # us


def bench_block(app: str, dtype: torch.dtype, size: str = "default") -> dict:
    import stitchflow
    from stitchflow.apps import APPS

    torch._dynamo.reset()
    model, inputs = APPS[app].build(size=size, dtype=dtype)
    model = model.cuda()
    inputs = tuple(x.cuda() if isinstance(x, torch.Tensor) else x for x in inputs)
    row = {"app": app, "size": size, "dtype": str(dtype).removeprefix("torch."),
           "shapes": [list(x.shape) for x in inputs if isinstance(x, torch.Tensor)]}
    tol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-3
    with torch.no_grad():
        ref = as_tuple(model(*inputs))[0]
        runners = {
            "eager": lambda: model,
            "torch.compile": lambda: torch.compile(model, dynamic=False),
            "backend=stitchflow": lambda: torch.compile(model, backend="stitchflow", dynamic=False),
            "stitchflow.compile": lambda: stitchflow.compile(model, inputs, target="gpu", fusion="auto"),
        }
        for name, make in runners.items():
            row[f"{name} us"] = None
            try:  # one failing competitor must not hide the others
                fn = make()
                err = relative_error(as_tuple(fn(*inputs))[0], ref)
                row[f"{name} err"] = err
                if err <= tol:
                    row[f"{name} us"] = _time(fn, inputs)
            except Exception as exc:
                row[f"{name} error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    base = row["torch.compile us"]
    for name in ("backend=stitchflow", "stitchflow.compile"):
        t = row.get(f"{name} us")
        row[f"{name} vs compile"] = base / t if t and base else None
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="stitchflow.bench.stitching_blocks", description=__doc__)
    parser.add_argument("--apps", default="bert,llama")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--size", default="default")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    rows = []
    for app in args.apps.split(","):
        try:
            rows.append(bench_block(app, getattr(torch, args.dtype), args.size))
        except Exception as err:  # report and go on with the next block
            rows.append({"app": app, "error": f"{type(err).__name__}: {err}"})
        print(json.dumps(rows[-1], default=str), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
