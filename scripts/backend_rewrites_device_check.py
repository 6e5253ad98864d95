"""Session 50's backend rewrites on CUDA tensors: the vmap bodies of tests/test_backend_vmap.py, the empty scan tail
of tests/test_backend_partition.py (inference and a training step) and histc (float32, and int32 as transformers'
MoE routers pass it on CUDA, whose integer histc bins in integer arithmetic), each through
torch.compile(backend="stitchflow") against eager on the same inputs. Prints one line per case and the fallbacks.

    PYTHONPATH=.:tests python scripts/backend_rewrites_device_check.py [--device cuda]
"""

from __future__ import annotations

import argparse

import torch

import stitchflow.backend as backend
from test_backend_partition import _scan_with_an_empty_tail
from test_backend_vmap import BODIES


def _histc_cases():
    def floats(x):
        return torch.histc(x * 1.5, 7, -1.5, 2.0)

    def integers(x):
        ids = (x.abs() * 3).int()  # expert ids 0..
        return torch.histc(ids, 4, 0, 3)

    return {"histc float32": (floats, [(200,)]), "histc int32 (CUDA's integer bins)": (integers, [(200,)])}


def _check(name, fn, shapes, device, train=False) -> bool:
    torch._dynamo.reset()
    backend.FALLBACKS.clear()
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=g).to(device).requires_grad_(train) for s in shapes]
    try:
        want = fn(*args)
        got = torch.compile(fn, backend="stitchflow")(*args)
        pairs = list(zip(got, want)) if isinstance(got, tuple) else [(got, want)]
        if train:
            want_grads = torch.autograd.grad(want.sum(), args)
            got_grads = torch.autograd.grad(got.sum(), args)
            pairs += list(zip(got_grads, want_grads))
        err = max(float((a.detach().float() - b.detach().float()).abs().max()) for a, b in pairs)
        ok = err <= 1e-4
    except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
        print(f"ERROR    {name}: {type(e).__name__}: {e}")
        return False
    print(f"{'ok' if ok else 'MISMATCH':8} {name:60} err {err:.1e} fallbacks {len(backend.FALLBACKS)}"
          f" regions {backend.regions_executed()}")
    for reason in dict.fromkeys(backend.FALLBACKS):
        print(f"           fallback: {reason[:160]}")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    cases = {f"vmap: {k}": v for k, v in BODIES.items()} | _histc_cases()
    cases["empty scan tail"] = (lambda x: _scan_with_an_empty_tail(x, 8), [(3, 8)])
    results = [_check(name, fn, shapes, args.device) for name, (fn, shapes) in cases.items()]
    results.append(_check("empty scan tail, training", lambda x: _scan_with_an_empty_tail(x, 4).square(), [(3, 8)],
                          args.device, train=True))
    print(f"{sum(results)}/{len(results)} ok")


if __name__ == "__main__":
    main()
