"""Device probe: which access patterns of a 65536x1024 fp32 column pass can run near copy bandwidth? No barriers, no
exchange: each program copies x*2 over its piece (BP columns x ROWS rows; programs ordered column block by column
block, `split` per block), once from registers, or twice (a first pass that sums the piece with the lines kept in
L2, a second that reads it again and stores), to see what a wider slab buys. Not a test: prints one line each."""
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

R, C = 65536, 1024


@triton.jit
def pieces(x, y, BP: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr, TWICE: tl.constexpr,
           num_cols: tl.constexpr, num_rows: tl.constexpr):
    pid = tl.program_id(0)
    split: tl.constexpr = num_rows // ROWS
    blk, s = pid // split, pid % split
    p = blk * BP + tl.arange(0, BP)[:, None]
    acc = tl.zeros((BP, 1), tl.float32)
    if TWICE:
        for r0 in range(s * ROWS, s * ROWS + ROWS, CHUNK):
            r = r0 + tl.arange(0, CHUNK)[None, :]
            acc += tl.sum(tl.load(x + r * num_cols + p, eviction_policy="evict_last"), axis=1, keep_dims=True)
    for r0 in range(s * ROWS, s * ROWS + ROWS, CHUNK):
        r = r0 + tl.arange(0, CHUNK)[None, :]
        v = tl.load(x + r * num_cols + p, eviction_policy="evict_first")
        tl.store(y + r * num_cols + p, v * 2.0 + acc * 0.0)


def main():
    x = torch.randn(R, C, device="cuda")
    y = torch.empty_like(x)
    floor = 2 * x.numel() * 4
    copy = do_bench(lambda: y.copy_(x), warmup=5, rep=50, return_mode="median") * 1e-3
    print(f"torch copy {copy * 1e6:.1f} us ({floor / copy / 1e12:.2f} TB/s)")
    for twice in (False, True):
        for bp, rows, chunk, warps in ((32, 1024, 1024, 8), (64, 512, 512, 8), (128, 256, 256, 8), (256, 128, 128, 8),
                                       (1024, 32, 32, 8), (32, 1024, 128, 4), (64, 1024, 64, 4), (128, 512, 32, 4),
                                       (128, 2048, 32, 4), (256, 256, 16, 4), (64, 4096, 64, 4)):
            if not twice and chunk != rows:
                continue
            grid = (C // bp) * (R // rows)
            t = do_bench(lambda: pieces[(grid,)](x, y, BP=bp, ROWS=rows, CHUNK=chunk, TWICE=twice, num_cols=C,
                                                 num_rows=R, num_warps=warps),
                         warmup=5, rep=50, return_mode="median") * 1e-3
            assert torch.equal(y, x * 2.0)
            print(f"pieces {bp}x{rows} chunk {chunk} w{warps} twice={twice}: {t * 1e6:.1f} us, "
                  f"{copy / t:.0%} of copy", flush=True)


if __name__ == "__main__":
    main()
