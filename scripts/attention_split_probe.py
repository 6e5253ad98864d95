"""Split query tiles and longest-first launch order for the block-sparse attention kernel (H100 probe, not a test).

    PYTHONPATH=. python scripts/attention_split_probe.py [--cases b2h16s4096b64,b1h12s1024b16] [--chunks 0,4,8,16]

Per case (the bench's BigBird masks, bf16, head dim 64) and tile shape: the kernel with its work items in
query-tile order and nothing split, then longest first with runs of at most `chunk` key tiles (0: nothing split);
the launch walks an item's programs for every batch entry before the next item's. CUDA-graph medians, L2 evicted
clean; each output checked against the unsplit one. Also the merged-heads store: the kernel writing (B, S, H·D)
through strides against a contiguous output plus the copy.
"""

import argparse
import dataclasses
import math

import torch

from stitchflow.apps.bigbird import bigbird_block_mask
from stitchflow.bench.attention import parse_case
from stitchflow.targets.gpu.attention_kernel import Operand, launch, scratch
from stitchflow.targets.gpu.attention_plan import AttentionTiles, tile_plan
from stitchflow.targets.gpu.timing import graph_bench

TILES = (AttentionTiles(64, 64, 4, 3), AttentionTiles(64, 128, 4, 2), AttentionTiles(128, 64, 8, 3),
         AttentionTiles(64, 64, 4, 2))


def in_query_order(plan):
    """The plan's items sorted by query tile instead of longest first."""
    order = torch.argsort(plan.items[:, 0].cpu() * 1_000_000 + plan.items[:, 1].cpu(), stable=True)
    return dataclasses.replace(plan, items=plan.items[order.to(plan.items.device)].contiguous())


def run_case(case: str, chunks: list[int], tiles_list=TILES, narrow: bool = False) -> None:
    B, H, S, block = parse_case(case)
    D = 64
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    ops = [Operand(t, 0, tuple(t.stride()[:2]), t.stride(2), t.stride(3)) for t in (q, k, v)]
    b = torch.where(bigbird_block_mask(S, block, seed=0).dense_mask() > 0, 0.0, float("-inf"))
    scale = 1 / math.sqrt(D)
    out = torch.empty_like(q)
    merged = torch.empty(B, S, H * D, device="cuda", dtype=torch.bfloat16)
    merged_view = merged.view(B, S, H, D).transpose(1, 2)

    def timed(plan, target=out):
        parts = scratch(plan, B * H, D, torch.bfloat16, "cuda")
        fn = lambda: launch(*ops, target, (B, H), plan, S, S, D, D, "ieee", parts=parts)  # noqa: E731
        return graph_bench(fn)[0] * 1e6

    for tiles in tiles_list:
        base = tile_plan(scale, b, tiles, narrow).to("cuda")
        offsets = " bf16 offsets" if narrow else ""
        line = [f"{case} {tiles}{offsets}: {base.visited} tiles over {base.start.shape[0]} query tiles, "
                f"longest {base.longest}"]
        line.append(f"query order {timed(in_query_order(base)):.1f}")
        ref = out.clone()
        for chunk in chunks:
            plan = tile_plan(scale, b, tiles.chunked(chunk), narrow).to("cuda")
            t = timed(plan)
            err = (out.float() - ref.float()).abs().max().item()
            line.append(f"c{chunk} {t:.1f} ({plan.parts} parts, err {err:.1e})")
        plan = tile_plan(scale, b, tiles, narrow).to("cuda")
        copy = graph_bench(lambda: merged.copy_(out.transpose(1, 2).flatten(-2)))[0] * 1e6
        line.append(f"merged-heads store c0 {timed(plan, merged_view):.1f} (the copy alone {copy:.1f})")
        print("; ".join(line), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="b2h16s4096b64,b1h12s1024b16,b1h12s1024b32,b1h12s1024b64")
    parser.add_argument("--chunks", default="0,2,4,8,16")
    parser.add_argument("--tiles", default="", help="tile shapes instead of TILES, bm:bn:warps:stages,...")
    parser.add_argument("--narrow", default="0", help="partial tiles' offsets in bf16 where exact: 0, 1 or 0,1")
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    tiles = [AttentionTiles(*map(int, t.split(":"))) for t in args.tiles.split(",") if t] or TILES
    for narrow in (bool(int(n)) for n in args.narrow.split(",")):
        for case in args.cases.split(","):
            run_case(case, chunks, tiles, narrow)


if __name__ == "__main__":
    main()
