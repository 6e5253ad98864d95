"""Device probe: a mixture-of-experts router (gate logits -> softmax over the experts -> top-k -> renormalised
weights) through stitchflow's gpu target, against eager and torch.compile on the same inputs, bf16. The gate's
GEMM is left out (its logits are the input) so that the number is the memory-bound part that stitchflow fuses:
softmax, the rank-based top-k and the renormalisation in one kernel. Medians of CUDA-graph replays, L2 evicted
clean before each (targets/gpu/timing.py); the answer checked against eager first. Not a test.

    PYTHONPATH=. python3 scripts/router_probe.py
"""
import torch

import stitchflow
from stitchflow.targets.gpu.timing import graph_bench

SHAPES = ((16384, 8, 2), (16384, 64, 8), (65536, 16, 2), (4096, 128, 8))


def route(logits: torch.Tensor, k: int):
    weights, experts = torch.topk(torch.softmax(logits.float(), -1), k)
    return (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), experts


def main():
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print("| tokens x experts, k | eager µs | torch.compile µs | stitchflow µs | vs eager | vs compile | equal |")
    print("|---|---|---|---|---|---|---|")
    for tokens, experts, k in SHAPES:
        logits = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16)
        fn = lambda x, k=k: route(x, k)  # noqa: E731
        prog = stitchflow.compile(fn, (logits,), target="gpu", fusion="full", options={"cuda_graphs": False})
        ours, ref = prog(logits), fn(logits)
        # eager's top-k orders ties (frequent among bf16 logits) as it likes: the experts picked must carry the
        # weights eager picked, and the weights must agree
        probs = torch.softmax(logits.float(), -1)
        equal = (torch.equal(probs.gather(-1, ours[1]), probs.gather(-1, ref[1]))
                 and torch.allclose(ours[0].float(), ref[0].float(), rtol=2e-2, atol=2e-2))
        compiled = torch.compile(fn)
        compiled(logits)
        times = {name: graph_bench(lambda call=call: call(logits))[0] * 1e6
                 for name, call in (("eager", fn), ("compile", compiled), ("ours", prog))}
        print(f"| {tokens} x {experts}, {k} | {times['eager']:.1f} | {times['compile']:.1f} | {times['ours']:.1f} | "
              f"{times['eager'] / times['ours']:.2f}x | {times['compile'] / times['ours']:.2f}x | {equal} |")


if __name__ == "__main__":
    main()
