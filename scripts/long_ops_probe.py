"""Device probe: session 54's long scans and sorts, and the Fourier transforms as DFT GEMMs, each through
stitchflow.compile(target="gpu") against eager and torch.compile on the same inputs (CUDA-graph medians, L2 evicted
clean: targets/gpu/timing.py). Checked against eager first. Not a test.

- sorts: a MoE router's stable argsort of expert ids (tokens x top-k ids in [0, experts)), top-p sampling's
  descending sort of a vocabulary's logits;
- scans: position ids from an attention mask (cumsum over a long sequence), top-p's cumulative probabilities;
- transforms: FNet's 2-d transform's real part over (sequence, hidden), an STFT's frames (one-sided, 512 bins).

    PYTHONPATH=. python3 scripts/long_ops_probe.py [--only sort,scan,fft]
"""
import argparse

import torch

import stitchflow
from stitchflow.targets.gpu.timing import against_torch, against_torch_cells


def _cases():
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = lambda n: torch.randint(0, 64, (n,), device="cuda", generator=g)  # noqa: E731
    yield "sort", "argsort 2048 expert ids", lambda e: torch.argsort(e, stable=True), (ids(2048),)
    yield "sort", "argsort 16384 expert ids", lambda e: torch.argsort(e, stable=True), (ids(16384),)
    logits = torch.randn(4, 32000, device="cuda", generator=g)
    yield "sort", "sort 4x32000 logits", lambda x: torch.sort(x, descending=True), (logits,)
    mask = (torch.rand(8, 8192, device="cuda", generator=g) > 0.05).long()
    yield "scan", "cumsum 8x8192 mask", lambda m: m.cumsum(-1) - 1, (mask,)
    probs = torch.softmax(logits, -1)
    yield "scan", "cumsum 4x32000 probs", lambda p: p.cumsum(-1), (probs,)
    h = torch.randn(8, 512, 768, device="cuda", generator=g)
    yield "fft", "FNet fft2 8x512x768", lambda x: torch.fft.fft2(x, dim=(-2, -1)).real, (h,)
    wave = torch.randn(8, 16000, device="cuda", generator=g)
    window = torch.hann_window(1024, device="cuda")
    yield "fft", "stft 8x16000 n_fft 1024", lambda w: torch.stft(w, 1024, 256, window=window, return_complex=True
                                                                 ).abs(), (wave,)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="sort,scan,fft")
    args = ap.parse_args(argv)
    kinds = set(args.only.split(","))
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print("| case | eager µs | torch.compile µs | stitchflow µs | vs eager | vs compile | max error |")
    print("|---|---|---|---|---|---|---|")
    for kind, name, fn, inputs in _cases():
        if kind not in kinds:
            continue
        try:
            ours = stitchflow.compile(fn, inputs, target="gpu", fusion="auto")
            out, ref = ours(*inputs), fn(*inputs)
            out, ref = (out if isinstance(out, tuple) else (out,)), (ref if isinstance(ref, tuple) else (ref,))
            error = max(((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()
                        for a, b in zip(out, ref))
            times = against_torch(fn, ours, inputs)
        except Exception as e:  # a probe: report and go on
            print(f"| {name} | error: {type(e).__name__}: {str(e)[:160]} |", flush=True)
            continue
        print(f"| {name} | {against_torch_cells(times, error)}", flush=True)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
