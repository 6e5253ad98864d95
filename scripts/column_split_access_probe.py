"""Device probe: in the column patterns' access pattern (a program per 32 columns x 1024 rows, 64 programs per column
block, blocks in order), is it the loads or the stores that keep a 65536x1024 fp32 pass under copy bandwidth? Each
side reads or writes either its column piece or a contiguous 128 KB stretch of the same size. Not a test: prints one
line per combination."""
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

R, C = 65536, 1024


@triton.jit
def passes(x, y, COL_LOADS: tl.constexpr, COL_STORES: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr,
           CHUNK: tl.constexpr, num_cols: tl.constexpr, num_rows: tl.constexpr):
    pid = tl.program_id(0)
    split: tl.constexpr = num_rows // ROWS
    blk, s = pid // split, pid % split
    p = tl.arange(0, BP)[:, None]
    for r0 in range(0, ROWS, CHUNK):
        r = r0 + tl.arange(0, CHUNK)[None, :]
        col = (s * ROWS + r) * num_cols + blk * BP + p  # the piece's element
        flat = pid * (BP * ROWS) + r * BP + p  # the same count, contiguous
        v = tl.load(x + (col if COL_LOADS else flat))
        tl.store(y + (col if COL_STORES else flat), v * 2.0)


def main():
    x = torch.randn(R, C, device="cuda")
    y = torch.empty_like(x)
    copy = do_bench(lambda: y.copy_(x), warmup=5, rep=50, return_mode="median") * 1e-3
    print(f"torch copy {copy * 1e6:.1f} us ({2 * x.numel() * 4 / copy / 1e12:.2f} TB/s)")
    grid = (C // 32 * (R // 1024),)
    for loads, stores in ((True, True), (True, False), (False, True), (False, False)):
        for chunk in (64, 128):
            def run():
                passes[grid](x, y, COL_LOADS=loads, COL_STORES=stores, BP=32, ROWS=1024, CHUNK=chunk, num_cols=C,
                             num_rows=R, num_warps=8)
            t = do_bench(run, warmup=5, rep=50, return_mode="median") * 1e-3
            print(f"loads {'column' if loads else 'flat'}, stores {'column' if stores else 'flat'}, chunk {chunk}: "
                  f"{t * 1e6:.1f} us, {copy / t:.0%} of copy", flush=True)


if __name__ == "__main__":
    main()
