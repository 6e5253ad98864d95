"""Device probe: what bounds the cooperative column kernels (column_center at 74% of copy bandwidth)? Times, on the
bench's 65536x1024 fp32 tensor, Triton kernels with the coop kernel's access pattern (a program per 32 columns x
`rows` rows piece, 64 programs per column block) that copy x*2 (no barrier), the same with the group barrier but no
data dependence on it, column_center written by hand, and a plain row-tiled copy; do_bench medians (each timed call
also zeroes the 32 arrival counters). Not a test: prints one line each."""
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

R, C, BP = 65536, 1024, 32


@triton.jit
def piece_copy(x, y, cnt, ROWS: tl.constexpr, SPLIT: tl.constexpr, BARRIER: tl.constexpr, num_cols: tl.constexpr):
    pid = tl.program_id(0)
    blk, s = pid // SPLIT, pid % SPLIT
    p = blk * 32 + tl.arange(0, 32)[:, None]
    r = s * ROWS + tl.arange(0, ROWS)[None, :]
    v = tl.load(x + r * num_cols + p)
    if BARRIER:
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt + blk, 1, sem="acq_rel", scope="gpu") + 1
        while arrived < SPLIT:
            arrived = tl.atomic_add(cnt + blk, 0, sem="acquire", scope="gpu")
    tl.store(y + r * num_cols + p, v * 2.0)


@triton.jit
def piece_center(x, y, cnt, part, ROWS: tl.constexpr, SPLIT: tl.constexpr, num_cols: tl.constexpr,
                 num_rows: tl.constexpr, SCALE_FIRST: tl.constexpr):
    """column_center by hand: the piece's column sums, published; the group barrier; everyone's sums; x - mean."""
    pid = tl.program_id(0)
    blk, s = pid // SPLIT, pid % SPLIT
    p = blk * 32 + tl.arange(0, 32)[:, None]
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
    for rows, warps in ((1024, 8), (1024, 16), (512, 8), (2048, 16)):
        split = R // rows
        if split > 64:
            continue
        for barrier in (False, True):
            cnt = torch.zeros(C // BP, dtype=torch.int32, device="cuda")

            def run():
                cnt.zero_()
                piece_copy[(C // BP * split,)](x, y, cnt, ROWS=rows, SPLIT=split, BARRIER=barrier, num_cols=C,
                                               num_warps=warps)
            t = do_bench(run, warmup=5, rep=50, return_mode="median") * 1e-3
            assert torch.equal(y, x * 2.0)
            print(f"pieces 32x{rows} ({split} per block) w{warps} barrier={barrier}: {t * 1e6:.1f} us, "
                  f"{floor / rate / t:.0%} of copy", flush=True)
        for scale_first in (True, False):
            cnt = torch.zeros(C // BP, dtype=torch.int32, device="cuda")
            part = torch.empty(split, C, device="cuda")

            def center():
                cnt.zero_()
                piece_center[(C // BP * split,)](x, y, cnt, part, ROWS=rows, SPLIT=split, num_cols=C, num_rows=R,
                                                 SCALE_FIRST=scale_first, num_warps=warps)
            t = do_bench(center, warmup=5, rep=50, return_mode="median") * 1e-3
            assert torch.allclose(y, x - x.mean(0, keepdim=True), atol=1e-5)
            print(f"center by hand, pieces 32x{rows} w{warps} scale_first={scale_first}: {t * 1e6:.1f} us, "
                  f"{floor / rate / t:.0%} of copy", flush=True)


if __name__ == "__main__":
    main()
