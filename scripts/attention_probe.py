"""Where the block-sparse attention kernel stands against flash attention (H100 probe, not a test).

    PYTHONPATH=.:scripts python scripts/attention_probe.py [--seq 4096] [--batch 2] [--heads 16]

Times (CUDA-graph replays, L2 evicted clean before each) our kernel on a dense plan (every tile visited, uniform)
against SDPA's flash kernel on the same dense problem, then on the BigBird plan at every candidate tile shape,
with the number of partial tiles each shape makes: is the loss the kernel's own efficiency, or the sparsity?
"""

import argparse
import dataclasses
import math

import torch
import torch.nn.functional as F

from stitchflow.apps.bigbird import bigbird_block_mask
from stitchflow.targets.gpu.attention import candidates
from stitchflow.targets.gpu.attention_kernel import Operand, launch
from stitchflow.targets.gpu.attention_plan import AttentionTiles, tile_plan
from stitchflow.targets.gpu.timing import graph_bench


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--extra", default="", help="more tile shapes, bm:bn:warps:stages,...")
    args = parser.parse_args()
    B, H, S, D = args.batch, args.heads, args.seq, args.dim
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ops = [Operand(t, 0, tuple(t.stride()[:2]), t.stride(2), t.stride(3)) for t in (q, k, v)]
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(D)
    flops = 4 * B * H * S * S * D

    def ours(plan):
        return graph_bench(lambda: launch(*ops, out, (B, H), plan, S, S, D, D, "ieee"))[0] * 1e6

    flash = graph_bench(lambda: F.scaled_dot_product_attention(q, k, v))[0] * 1e6
    print(f"dense flash SDPA: {flash:.1f} us, {flops / flash / 1e6:.0f} TFLOP/s")
    mask = bigbird_block_mask(S, args.block, seed=0)
    dense_b = torch.zeros(S, S)
    sparse_b = torch.where(mask.dense_mask() > 0, 0.0, float("-inf"))
    extra = [AttentionTiles(*map(int, t.split(":"))) for t in args.extra.split(",") if t]
    for tiles in (*candidates(torch.bfloat16, D), *extra):
        dense = ours(tile_plan(scale, dense_b, tiles).to("cuda"))
        plan = tile_plan(scale, sparse_b, tiles).to("cuda")
        sparse = ours(plan)
        visited = plan.visited * tiles.bm * tiles.bn / S / S  # fraction of the score matrix computed
        print(f"{tiles}: dense {dense:.1f} us ({flops / dense / 1e6:.0f} TFLOP/s); bigbird {sparse:.1f} us, "
              f"{plan.visited} tiles ({plan.partial} partial, {visited:.1%} of the scores), "
              f"{flops * visited / sparse / 1e6:.0f} TFLOP/s on the visited tiles", flush=True)
        if plan.partial:
            uniform = tile_plan(scale, sparse_b, tiles)
            forced = dataclasses.replace(uniform, slot=torch.full_like(uniform.slot, -1), offsets=uniform.offsets[:1])
            print(f"   same tiles, partial ones run as uniform (wrong result, timing only): "
                  f"{ours(forced.to('cuda')):.1f} us", flush=True)


if __name__ == "__main__":
    main()
