"""Device probe: what bounds the cooperative column kernels (column_center at 74% of copy bandwidth)? Times, on the
bench's 65536x1024 fp32 tensor, Triton kernels with the coop kernel's access pattern (a program per 32 columns x
`rows` rows piece, 64 programs per column block) that copy x*2 (no barrier), the same with the group barrier but no
data dependence on it, column_center written by hand, and a plain row-tiled copy; do_bench medians (each timed call
also zeroes the 32 arrival counters). Not a test: prints one line each."""
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

R, C = 65536, 1024


@triton.jit
def piece_copy(x, y, cnt, BP: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr, BARRIER: tl.constexpr, num_cols: tl.constexpr):
    pid = tl.program_id(0)
    blk, s = pid // SPLIT, pid % SPLIT
    p = blk * BP + tl.arange(0, BP)[:, None]
    r = s * ROWS + tl.arange(0, ROWS)[None, :]
    v = tl.load(x + r * num_cols + p)
    if BARRIER:
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt + blk, 1, sem="acq_rel", scope="gpu") + 1
        while arrived < SPLIT:
            arrived = tl.atomic_add(cnt + blk, 0, sem="acquire", scope="gpu")
    tl.store(y + r * num_cols + p, v * 2.0)


@triton.jit
def piece_center(x, y, cnt, part, BP: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr, num_cols: tl.constexpr,
                 num_rows: tl.constexpr, SCALE_FIRST: tl.constexpr):
    """column_center by hand: the piece's column sums, published; the group barrier; everyone's sums; x - mean."""
    pid = tl.program_id(0)
    blk, s = pid // SPLIT, pid % SPLIT
    p = blk * BP + tl.arange(0, BP)[:, None]
    r = s * ROWS + tl.arange(0, ROWS)[None, :]
    v = tl.load(x + r * num_cols + p)
    if SCALE_FIRST:  # as the generated kernel: each element scaled by 1/n, then summed
        own = tl.sum(v * (1.0 / num_rows), axis=1, keep_dims=True)
    else:
        own = tl.sum(v, axis=1, keep_dims=True) * (1.0 / num_rows)
    tl.store(part + s * num_cols + p, own)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt + blk, 1, sem="acq_rel", scope="gpu") + 1
    while arrived < SPLIT:
        arrived = tl.atomic_add(cnt + blk, 0, sem="acquire", scope="gpu")
    k = tl.arange(0, SPLIT)[None, :]
    mean = tl.sum(tl.load(part + k * num_cols + p, cache_modifier=".cg"), axis=1, keep_dims=True)
    tl.store(y + r * num_cols + p, v - mean)


SENTINEL = 0x7FBADBAD  # a NaN no arithmetic produces: partials are canonicalised before they are stored


@triton.jit
def piece_center_tagged(x, y, part, BP: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr, num_cols: tl.constexpr,
                        num_rows: tl.constexpr, POLL_ONE: tl.constexpr):
    """column_center with no counter: the partials buffer starts filled with a sentinel NaN, and each
    program polls everyone's partials until none is the sentinel (the exchange is the barrier)."""
    pid = tl.program_id(0)
    blk, s = pid // SPLIT, pid % SPLIT
    p = blk * BP + tl.arange(0, BP)[:, None]
    r = s * ROWS + tl.arange(0, ROWS)[None, :]
    v = tl.load(x + r * num_cols + p)
    own = tl.sum(v, axis=1, keep_dims=True) * (1.0 / num_rows)
    own = tl.where(own == own, own, float("nan"))
    tl.store(part + s * num_cols + p, own.to(tl.int32, bitcast=True))
    k = tl.arange(0, SPLIT)[None, :]
    if POLL_ONE:  # one column's partials first: 256 bytes per poll instead of 8 KB
        first = part + k * num_cols + blk * BP
        pending = tl.max((tl.load(first, volatile=True) == 0x7FBADBAD).to(tl.int32))
        while pending > 0:
            pending = tl.max((tl.load(first, volatile=True) == 0x7FBADBAD).to(tl.int32))
    raw = tl.load(part + k * num_cols + p, volatile=True)
    while tl.max(tl.max((raw == 0x7FBADBAD).to(tl.int32), axis=1), axis=0) > 0:
        raw = tl.load(part + k * num_cols + p, volatile=True)
    mean = tl.sum(raw.to(tl.float32, bitcast=True), axis=1, keep_dims=True)
    tl.store(y + r * num_cols + p, v - mean)


@triton.jit
def piece_center_pipelined(x, y, part, ROWS: tl.constexpr, SPLIT: tl.constexpr, BP: tl.constexpr,
                           GROUPS: tl.constexpr, num_cols: tl.constexpr, num_rows: tl.constexpr):
    """column_center on a persistent grid of GROUPS groups of SPLIT programs, each walking column blocks of BP
    columns: publish the piece's sums, issue the next block's piece loads, poll everyone's sums (sentinel-tagged,
    no counter and so no release fence before the prefetch), store. Two pieces live per program."""
    pid = tl.program_id(0)
    g, s = pid // SPLIT, pid % SPLIT
    nblk: tl.constexpr = num_cols // BP
    c = tl.arange(0, BP)[:, None]
    r = s * ROWS + tl.arange(0, ROWS)[None, :]
    k = tl.arange(0, SPLIT)[None, :]
    v = tl.load(x + r * num_cols + g * BP + c)
    for blk in range(g, nblk, GROUPS):
        p = blk * BP + c
        own = tl.sum(v, axis=1, keep_dims=True) * (1.0 / num_rows)
        own = tl.where(own == own, own, float("nan"))
        tl.store(part + s * num_cols + p, own.to(tl.int32, bitcast=True))
        nxt = blk + GROUPS
        following = tl.load(x + r * num_cols + nxt * BP + c, mask=(c * 0 + nxt) < nblk, other=0.0)
        raw = tl.load(part + k * num_cols + p, volatile=True)
        while tl.max(tl.max((raw == 0x7FBADBAD).to(tl.int32), axis=1), axis=0) > 0:
            raw = tl.load(part + k * num_cols + p, volatile=True)
        mean = tl.sum(raw.to(tl.float32, bitcast=True), axis=1, keep_dims=True)
        tl.store(y + r * num_cols + p, v - mean)
        v = following


@triton.jit
def row_copy(x, y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n) * 2.0, mask=i < n)


def main():
    x = torch.randn(R, C, device="cuda")
    y = torch.empty_like(x)
    floor = 2 * x.numel() * 4
    copy = do_bench(lambda: y.copy_(x), warmup=5, rep=50, return_mode="median") * 1e-3
    rate = floor / copy
    print(f"torch copy {copy * 1e6:.1f} us ({rate / 1e12:.2f} TB/s)")
    t = do_bench(lambda: row_copy[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), BLOCK=4096, num_warps=8),
                 warmup=5, rep=50, return_mode="median") * 1e-3
    print(f"row-tiled x*2: {t * 1e6:.1f} us, {floor / rate / t:.0%} of copy")
    if "--pipelined" in sys.argv:
        return pipelined(x, y, floor, rate)
    for bp, rows, warps in ((32, 1024, 8), (64, 512, 8), (64, 512, 16), (32, 512, 4)):
        split = R // rows
        for barrier in (False, True):
            cnt = torch.zeros(C // bp, dtype=torch.int32, device="cuda")

            def run():
                cnt.zero_()
                piece_copy[(C // bp * split,)](x, y, cnt, BP=bp, ROWS=rows, SPLIT=split, BARRIER=barrier, num_cols=C,
                                               num_warps=warps)
            t = do_bench(run, warmup=5, rep=50, return_mode="median") * 1e-3
            assert torch.equal(y, x * 2.0)
            print(f"pieces {bp}x{rows} ({split} per block) w{warps} barrier={barrier}: {t * 1e6:.1f} us, "
                  f"{floor / rate / t:.0%} of copy", flush=True)
        for scale_first in (False,):
            cnt = torch.zeros(C // bp, dtype=torch.int32, device="cuda")
            part = torch.empty(split, C, device="cuda")

            def center():
                cnt.zero_()
                piece_center[(C // bp * split,)](x, y, cnt, part, BP=bp, ROWS=rows, SPLIT=split, num_cols=C, num_rows=R,
                                                 SCALE_FIRST=scale_first, num_warps=warps)
            t = do_bench(center, warmup=5, rep=50, return_mode="median") * 1e-3
            assert torch.allclose(y, x - x.mean(0, keepdim=True), atol=1e-5)
            print(f"center by hand, pieces {bp}x{rows} w{warps} scale_first={scale_first}: {t * 1e6:.1f} us, "
                  f"{floor / rate / t:.0%} of copy", flush=True)

        for poll_one in (False,):
            part = torch.empty(split, C, dtype=torch.int32, device="cuda")

            def tagged():
                part.fill_(SENTINEL)
                piece_center_tagged[(C // bp * split,)](x, y, part, BP=bp, ROWS=rows, SPLIT=split, num_cols=C, num_rows=R,
                                                        POLL_ONE=poll_one, num_warps=warps)
            t = do_bench(tagged, warmup=5, rep=50, return_mode="median") * 1e-3
            assert torch.allclose(y, x - x.mean(0, keepdim=True), atol=1e-5)
            print(f"center tagged, pieces {bp}x{rows} w{warps} poll_one={poll_one}: {t * 1e6:.1f} us, "
                  f"{floor / rate / t:.0%} of copy", flush=True)

    pipelined(x, y, floor, rate)


def pipelined(x, y, floor, rate):
    for bp, rows, warps in ((32, 512, 8), (16, 1024, 8), (8, 2048, 8), (32, 512, 16), (16, 512, 4)):
        split = R // rows
        groups = max(1, 132 // split) if split <= 132 else 1
        if split > 132 and rows * bp * 4 * 2 > 128 * 1024:
            continue
        part = torch.empty(split, C, dtype=torch.int32, device="cuda")

        def run():
            part.fill_(SENTINEL)
            piece_center_pipelined[(groups * split,)](x, y, part, ROWS=rows, SPLIT=split, BP=bp, GROUPS=groups,
                                                      num_cols=C, num_rows=R, num_warps=warps)
        t = do_bench(run, warmup=5, rep=50, return_mode="median") * 1e-3
        assert torch.allclose(y, x - x.mean(0, keepdim=True), atol=1e-5)
        print(f"center pipelined, {groups} groups of {split} x pieces {bp}x{rows} w{warps}: {t * 1e6:.1f} us, "
              f"{floor / rate / t:.0%} of copy", flush=True)


if __name__ == "__main__":
    main()
