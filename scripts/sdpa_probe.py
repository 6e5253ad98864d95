"""Device probe: F.scaled_dot_product_attention through stitchflow (lowered to the IR's attention; the gpu target
times its block-sparse kernel against torch's attention and keeps the faster) against eager and torch.compile,
dense, causal and with a boolean mask, bf16. Prints µs per call of a loop of 50 calls (host included, L2 warm)
and what the attention step chose, with its kernel's time in the autotuner. Not a test.

    PYTHONPATH=. python3 scripts/sdpa_probe.py
"""
import torch
import torch.nn.functional as F

import stitchflow
from stitchflow.targets.gpu.attention import AttentionStep

SHAPES = ((4, 16, 2048, 64), (1, 12, 1024, 64), (8, 32, 512, 128))


def _per_call_us(call, calls: int = 50) -> float:
    """Wall time per call of a loop of calls, to the end of their device work: what a user's loop sees
    (a stitchflow program replays its own CUDA graph, which cannot be captured again inside another)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def main():
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for b, h, s, d in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        band = torch.ones(s, s, dtype=torch.bool, device="cuda").triu(-256).tril(256)
        for name, kwargs in (("dense", {}), ("causal", {"is_causal": True}), ("band512", {"attn_mask": band})):
            def fn(q, k, v, kwargs=kwargs):
                return F.scaled_dot_product_attention(q, k, v, **kwargs)

            ours = stitchflow.compile(fn, (q, k, v), target="gpu")
            compiled = torch.compile(fn)
            times = {}
            for label, run in (("eager", fn), ("torch.compile", compiled), ("stitchflow", ours)):
                for _ in range(3):
                    run(q, k, v)
                times[label] = _per_call_us(lambda run=run: run(q, k, v))
            err = (ours(q, k, v).float() - fn(q, k, v).float()).abs().max().item()
            steps = [st for c in ours.compiled for st in getattr(c, "steps", ()) if isinstance(st, AttentionStep)]
            chose = steps[0].describe().split("; ")[-1] if steps else "no attention step"
            if steps and steps[0].tuned_us is not None:
                chose += f" (its kernel {steps[0].tuned_us} µs in the autotuner)"
            print(f"B{b} H{h} S{s} D{d} {name}: " + ", ".join(f"{k} {t:.1f}" for k, t in times.items())
                  + f" µs; max err {err:.3g}; stitchflow: {chose}")


if __name__ == "__main__":
    main()
