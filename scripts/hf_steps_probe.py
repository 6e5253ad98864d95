"""Device probe: a Hugging Face model under torch.compile(backend="stitchflow"), step by step. For each model
(NAME or NAME:SIZE of apps/hf.py, bf16, CUDA): the error against eager over all rows and over the rows a padding
mask keeps, then every step of every compiled program timed with CUDA events in sequence (median of a few calls,
no CUDA graph), largest first, with what each step is. Also what torch's attention gives for a query whose every
key is masked, under each of its backends. Not a test.

    python scripts/hf_steps_probe.py [hf-llama,hf-llama:padded] [--top 25]
"""

import statistics
import sys
import time

import torch

import stitchflow.backend as backend
from stitchflow.apps import build_model
from stitchflow.targets.gpu.attention import AttentionStep
from stitchflow.targets.gpu.runtime import GroupKernel


class Timed:
    def __init__(self, step, label):
        self.step, self.label, self.pairs = step, label, []

    def __call__(self, env):
        if not torch.cuda.is_available():  # a dry run on the CPU (TRITON_INTERPRET=1): host time
            start = time.perf_counter()
            self.step(env)
            self.pairs.append((start, time.perf_counter()))
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.step(env)
        end.record()
        self.pairs.append((start, end))

    def median_us(self):
        if not torch.cuda.is_available():
            return statistics.median(e - s for s, e in self.pairs) * 1e6
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in self.pairs)


def label(step) -> str:
    if isinstance(step, GroupKernel):
        names = [n.name for p in step.plans for n in p.nodes]
        return f"kernel {step.title} cfg {[str(c) for c in (step.chosen or [])]} nodes {names[:6]}{'...' if len(names) > 6 else ''}"
    if isinstance(step, AttentionStep):
        return step.describe()
    return str(step)[:200]


def rows_error(got, want, mask):
    err = (got.double() - want.double()).norm(dim=-1)
    scale = want.double().norm(dim=-1).clamp_min(1e-30)
    rel = err / scale
    kept = mask.bool() if mask is not None else torch.ones(rel.shape, dtype=torch.bool, device=rel.device)
    worst_kept = rel[kept].max().item()
    worst_dropped = rel[~kept].max().item() if (~kept).any() else float("nan")
    return f"rows kept: worst {worst_kept:.3g}; rows padded: worst {worst_dropped:.3g}"


def fully_masked_rows():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(1, 2, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool, device="cuda").tril()
    mask[..., 0, :] = False
    for name in ("MATH", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", None):
        try:
            if name is None:
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            else:
                with sdpa_kernel(getattr(SDPBackend, name)):
                    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            row = out[0, 0, 0].float()
            print(f"  sdpa {name or 'default'}: fully masked row |row| {row.norm():.4g}, "
                  f"vs mean(V) {(row - v[0, 0].float().mean(0)).norm():.4g}, nan {row.isnan().any().item()}")
        except Exception as err:
            print(f"  sdpa {name}: {type(err).__name__}: {str(err)[:120]}")


def main():
    specs = (sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "hf-llama").split(",")
    top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 25
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        fully_masked_rows()
    for spec in specs:
        name, _, size = spec.partition(":")
        torch._dynamo.reset()
        backend.reset()
        model, inputs = build_model(name, size or "default", dtype=torch.bfloat16)
        model = model.to(device)
        inputs = tuple(x.to(device) for x in inputs)
        mask = inputs[1] if len(inputs) > 1 else None
        fn = torch.compile(model, backend="stitchflow", dynamic=False, options={"cuda_graphs": False, "target": "gpu"})
        with torch.no_grad():
            want = model(*inputs)
            got = fn(*inputs)
            got = fn(*inputs)
            print(f"== {spec}: relative error {((got.double() - want.double()).norm() / want.double().norm()).item():.4g}; "
                  f"{rows_error(got, want, mask)}; fallbacks {backend.FALLBACKS}", flush=True)
            timed = []
            for m in backend.COMPILED:
                for prog in m.programs.values():
                    for run in (prog._compiled if prog is not None else ()):
                        for k, step in enumerate(getattr(run, "steps", ())):  # a region of no steps: not timed
                            run.steps[k] = Timed(step, label(step))
                            timed.append(run.steps[k])
            for _ in range(5):
                fn(*inputs)
            if device == "cuda":
                torch.cuda.synchronize()
        total = sum(t.median_us() for t in timed)
        print(f"   {len(timed)} steps, {total:.0f} us in sequence", flush=True)
        for t in sorted(timed, key=lambda t: -t.median_us())[:top]:
            print(f"   {t.median_us():8.1f} us  {t.label[:230]}", flush=True)


if __name__ == "__main__":
    main()
