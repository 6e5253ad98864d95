"""Device probe: the column patterns as a software-pipelined two-pass kernel with L2 as the staging buffer.

The generated column kernels hold a 32-column block of all 65536 rows on chip (64 programs of 32x1024), because a
single read needs the whole column before any output; the 128-byte rows cost ~15 us against contiguous access, and
the group's barrier a few more. Here one persistent grid of P programs (each a fixed stretch of rows) walks column
blocks of BP columns: pass 1 of block k+1 (loads marked evict_last, the piece's mean and centred sum of squares
published, a release arrival) runs before pass 2 of block k (the group's statistics combined after an acquiring
poll that by then has long been satisfied, block k read again, now from L2, normalised and stored evict_first).
DRAM sees every byte once if L2 keeps two blocks; no program waits at a barrier it reached last.

    python scripts/column_l2_pipeline_probe.py

Not a test: prints one line per config (time, share of copy, max error against eager).

Measured on the H100 (session 9, copy 181.7 us): no gain. 16 KB chunks per SM in flight: 358-584 us (latency-bound);
64-128 KB: 260-316 us, best with 32-column blocks (center 260.7, standardize 263.9), against 213 / 218 for the
generated kernels. ncu, 32-column blocks: DRAM read 303 MB for a 268 MB input (pass 2 mostly hits L2) and 248 MB
written, so the traffic is near the floor but it moves at 2.1 TB/s; with 64-column blocks pass 2 misses (481 MB
read). Prefetching the next chunk in registers changed nothing. 16-column blocks gave wrong answers (an acquiring
poll by one thread does not order the other threads' partial loads; the generated kernels pass the poll's result
through shared memory and a barrier)."""
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

R, C = 65536, 1024


@triton.jit
def _pass1(x, part, cnt, pid, k, r0, P: tl.constexpr, C: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr,
           CH: tl.constexpr, HINT: tl.constexpr):
    cols = k * BP + tl.arange(0, BP)[None, :]
    mean = tl.zeros([BP], tl.float32)
    m2 = tl.zeros([BP], tl.float32)
    rows = r0 + tl.arange(0, CH)[:, None]
    v = tl.load(x + rows * C + cols, eviction_policy="evict_last" if HINT else "")
    for c in range(0, ROWS, CH):  # the next chunk's loads go out before this chunk is reduced
        rows = r0 + (c + CH) % ROWS + tl.arange(0, CH)[:, None]
        nxt = tl.load(x + rows * C + cols, eviction_policy="evict_last" if HINT else "")  # wraps to chunk 0
        cm = tl.sum(v, 0) / CH
        d = v - cm[None, :]
        cq = tl.sum(d * d, 0)
        delta = cm - mean
        n = c * 1.0
        mean = mean + delta * (CH / (n + CH))
        m2 = m2 + cq + delta * delta * (n * CH / (n + CH))
        v = nxt
    at = part + ((k * P + pid) * 2) * BP + tl.arange(0, BP)
    tl.store(at, mean)
    tl.store(at + BP, m2)
    tl.atomic_add(cnt + k, 1, sem="release", scope="gpu")


@triton.jit
def _pass2(x, y, part, cnt, target, j, r0, P: tl.constexpr, C: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr,
           CH: tl.constexpr, HINT: tl.constexpr, STANDARDIZE: tl.constexpr, NROWS: tl.constexpr):
    arrived = tl.atomic_add(cnt + j, 0, sem="acquire", scope="gpu")
    while arrived < target:
        arrived = tl.atomic_add(cnt + j, 0, sem="acquire", scope="gpu")
    at = part + ((j * P + tl.arange(0, P)[:, None]) * 2) * BP + tl.arange(0, BP)[None, :]
    pm = tl.load(at, cache_modifier=".cg")
    pq = tl.load(at + BP, cache_modifier=".cg")
    gm = tl.sum(pm, 0) / P
    spread = pm - gm[None, :]
    var = (tl.sum(pq, 0) + ROWS * tl.sum(spread * spread, 0)) / NROWS
    rstd = tl.rsqrt(var + 1e-5)
    cols = j * BP + tl.arange(0, BP)[None, :]
    rows = r0 + tl.arange(0, CH)[:, None]
    v = tl.load(x + rows * C + cols, eviction_policy="evict_first" if HINT else "")
    for c in range(0, ROWS, CH):
        rows = r0 + c + tl.arange(0, CH)[:, None]
        following = r0 + (c + CH) % ROWS + tl.arange(0, CH)[:, None]
        nxt = tl.load(x + following * C + cols, eviction_policy="evict_first" if HINT else "")
        out = v - gm[None, :]
        if STANDARDIZE:
            out = out * rstd[None, :]
        if HINT:
            tl.store(y + rows * C + cols, out, eviction_policy="evict_first")
        else:
            tl.store(y + rows * C + cols, out)
        v = nxt


@triton.jit
def pipelined(x, y, part, cnt, epoch, P: tl.constexpr, C: tl.constexpr, NROWS: tl.constexpr, BP: tl.constexpr,
              CH: tl.constexpr, HINT: tl.constexpr, STANDARDIZE: tl.constexpr):
    pid = tl.program_id(0)
    ROWS: tl.constexpr = NROWS // P
    r0 = pid * ROWS
    NB: tl.constexpr = C // BP
    target = (epoch + 1) * P  # counters are never reset: each launch adds P arrivals per block
    _pass1(x, part, cnt, pid, 0, r0, P, C, BP, ROWS, CH, HINT)
    for k in range(1, NB):
        _pass1(x, part, cnt, pid, k, r0, P, C, BP, ROWS, CH, HINT)
        _pass2(x, y, part, cnt, target, k - 1, r0, P, C, BP, ROWS, CH, HINT, STANDARDIZE, NROWS)
    _pass2(x, y, part, cnt, target, NB - 1, r0, P, C, BP, ROWS, CH, HINT, STANDARDIZE, NROWS)


def run(x, standardize: bool, P: int, BP: int, CH: int, hint: bool, warps: int):
    nrows, ncols = x.shape
    y = torch.empty_like(x)
    part = torch.empty(ncols // BP * P * 2 * BP, device=x.device)
    cnt = torch.zeros(ncols // BP, dtype=torch.int64, device=x.device)
    epoch = [0]
    options = {} if x.device.type == "cpu" else {"launch_cooperative_grid": True}

    def call():
        pipelined[(P,)](x, y, part, cnt, epoch[0], P=P, C=ncols, NROWS=nrows, BP=BP, CH=CH, HINT=hint,
                        STANDARDIZE=standardize, num_warps=warps, **options)
        epoch[0] += 1
        return y
    return call


def reference(x, standardize):
    mean = x.mean(0, keepdim=True)
    xc = x - mean
    return xc * torch.rsqrt((xc * xc).mean(0, keepdim=True) + 1e-5) if standardize else xc


def main():
    x = torch.randn(R, C, device="cuda")
    copy_y = torch.empty_like(x)
    copy = do_bench(lambda: copy_y.copy_(x), warmup=5, rep=50, return_mode="median") * 1e-3
    print(f"torch copy {copy * 1e6:.1f} us", flush=True)
    for standardize in (False, True):
        ref = reference(x, standardize)
        # one program per SM: a chunk of CH x BP is what each SM has in flight, so chunks must be large (first
        # run: 16 KB chunks, 358-584 us, latency-bound)
        for P, BP, CH, hint, warps in ((128, 32, 512, True, 8), (128, 32, 256, True, 8), (128, 32, 512, True, 16),
                                       (128, 16, 1024, True, 8)):
            call = run(x, standardize, P, BP, CH, hint, warps)
            try:
                err = (call() - ref).abs().max().item()
            except RuntimeError as e:  # a grid the occupancy cannot hold at once
                print(f"P={P} BP={BP} CH={CH} warps={warps}: {str(e).splitlines()[-1]}", flush=True)
                continue
            t = do_bench(call, warmup=5, rep=100, return_mode="median") * 1e-3
            print(f"{'standardize' if standardize else 'center'} P={P} BP={BP} CH={CH} hint={hint} warps={warps}: "
                  f"{t * 1e6:.1f} us, {copy / t:.0%} of copy, max error {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
