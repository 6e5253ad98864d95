"""Device probe: a mixture of experts' expert layer (transformers' grouped-GEMM experts: tokens sorted by expert,
gathered, gate/up grouped GEMM, SiLU-gated product, down grouped GEMM, weighted and summed back per token) through
stitchflow, against eager and torch.compile on the same inputs, bf16, Qwen3-MoE-30B-A3B's widths (hidden 2048,
128 experts of 768, top 8). Two rows per token count: the grouped GEMMs alone (sorted rows and offsets as inputs:
stitchflow.compile, target gpu), and the whole layer through torch.compile(backend="stitchflow") (a sort longer
than ops_sort.QUADRATIC_SORT is merge-ranked there). Medians of CUDA-graph replays, L2
evicted clean before each (targets/gpu/timing.py); every answer checked against eager first. Not a test.

    PYTHONPATH=. python3 scripts/moe_probe.py [--tokens 16,128,1024] [--experts 128] [--top 8]
"""
import argparse

import torch
import torch.nn.functional as F

import stitchflow
from stitchflow.targets.gpu.timing import against_torch, against_torch_cells


def grouped_experts(rows, gate_up, down, offs):
    gate, up = torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offs)


def expert_layer(hidden, chosen, weights, gate_up, down):
    ids, perm = torch.sort(chosen.reshape(-1))
    token = perm // chosen.shape[-1]
    counts = torch.histc(ids.int(), bins=gate_up.shape[0], min=0, max=gate_up.shape[0] - 1)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    out = grouped_experts(hidden[token], gate_up, down, offs) * weights.reshape(-1)[perm, None]
    return torch.zeros_like(hidden).index_add_(0, token, out)


def _inputs(tokens: int, experts: int, top: int, hidden: int, inner: int):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=g, dtype=torch.bfloat16)
    chosen = torch.rand(tokens, experts, device="cuda", generator=g).topk(top, dim=-1).indices
    weights = torch.rand(tokens, top, device="cuda", generator=g).softmax(-1).to(torch.bfloat16)
    gate_up = (torch.randn(experts, 2 * inner, hidden, device="cuda", generator=g) / hidden ** 0.5).to(torch.bfloat16)
    down = (torch.randn(experts, hidden, inner, device="cuda", generator=g) / inner ** 0.5).to(torch.bfloat16)
    return x, chosen, weights, gate_up, down


def _error(ours, ref) -> float:
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="16,128,1024")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inner", type=int, default=768)
    args = ap.parse_args(argv)
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; {args.experts} experts of "
          f"{args.hidden}->{args.inner}, top {args.top}, bf16")
    print("| tokens | part | eager µs | torch.compile µs | stitchflow µs | vs eager | vs compile | rel. error |")
    print("|---|---|---|---|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        x, chosen, weights, gate_up, down = _inputs(tokens, args.experts, args.top, args.hidden, args.inner)
        ids, perm = torch.sort(chosen.reshape(-1))
        offs = torch.cumsum(torch.bincount(ids, minlength=args.experts), 0).to(torch.int32)
        rows = x[perm // args.top]
        parts = {
            "grouped GEMMs": (grouped_experts, (rows, gate_up, down, offs),
                              stitchflow.compile(grouped_experts, (rows, gate_up, down, offs), target="gpu",
                                                 fusion="auto")),
            "expert layer": (expert_layer, (x, chosen, weights, gate_up, down),
                             torch.compile(expert_layer, backend="stitchflow")),
        }
        for part, (fn, inputs, ours) in parts.items():
            with torch.no_grad():
                ref = fn(*inputs)
                error = _error(ours(*inputs), ref)
                times = against_torch(fn, ours, inputs)
            print(f"| {tokens} | {part} | {against_torch_cells(times, error)}", flush=True)
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
