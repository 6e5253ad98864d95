"""Device probe: where does a cooperative column kernel's time go? column_center by hand on the bench's 65536x1024
fp32 tensor (a program per BP columns x ROWS rows, SPLIT programs per column block meeting at a counter barrier), each
program stamping %globaltimer when it starts, when its piece is loaded and summed, when the barrier releases it, and
after its stores issue, with its SM. Prints the mean phase times, the SMs' busy share, how far apart a group's
programs start, and writes a timeline PNG per config to $OUT (or the working directory). Not a test."""
import os
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

R, C = 65536, 1024


@triton.jit
def _stamp(dep):
    """(globaltimer, smid), ordered after `dep` (a scalar the caller must have computed)."""
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1)
    return t


@triton.jit
def timed_center(x, y, cnt, part, stamps, BP: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr,
                 num_cols: tl.constexpr, num_rows: tl.constexpr):
    pid = tl.program_id(0)
    blk, s = pid // SPLIT, pid % SPLIT
    t0 = _stamp(pid)
    p = blk * BP + tl.arange(0, BP)[:, None]
    r = s * ROWS + tl.arange(0, ROWS)[None, :]
    v = tl.load(x + r * num_cols + p)
    own = tl.sum(v, axis=1, keep_dims=True) * (1.0 / num_rows)
    t1 = _stamp(tl.sum(tl.sum(own, axis=1), axis=0))
    tl.store(part + s * num_cols + p, own)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt + blk, 1, sem="acq_rel", scope="gpu") + 1
    while arrived < SPLIT:
        arrived = tl.atomic_add(cnt + blk, 0, sem="acquire", scope="gpu")
    k = tl.arange(0, SPLIT)[None, :]
    mean = tl.sum(tl.load(part + k * num_cols + p, cache_modifier=".cg"), axis=1, keep_dims=True)
    t2 = _stamp(tl.sum(tl.sum(mean, axis=1), axis=0))
    tl.store(y + r * num_cols + p, v - mean)
    tl.debug_barrier()
    t3 = _stamp(arrived)
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [pid], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(stamps + pid * 5 + 0, t0)
    tl.store(stamps + pid * 5 + 1, t1)
    tl.store(stamps + pid * 5 + 2, t2)
    tl.store(stamps + pid * 5 + 3, t3)
    tl.store(stamps + pid * 5 + 4, sm.to(tl.int64))


def report(st, bp, rows, split, warps, out):
    st = st.cpu().double()
    t0, t1, t2, t3, sm = (st[:, i] for i in range(5))
    base = t0.min()
    t0, t1, t2, t3 = t0 - base, t1 - base, t2 - base, t3 - base
    span = float(t3.max()) / 1e3
    n_sm = int(sm.max()) + 1
    busy = float((t3 - t0).sum()) / 1e3 / (n_sm * span)
    groups = t0.view(-1, split)
    spread = float((groups.max(1).values - groups.min(1).values).mean()) / 1e3
    last_loaded = t1.view(-1, split).max(1).values
    release_lag = float((t2.view(-1, split).min(1).values - last_loaded).mean()) / 1e3
    print(f"{bp}x{rows} split {split} w{warps}: span {span:.1f} us; means: load+sum {float((t1 - t0).mean()) / 1e3:.2f}"
          f" us, wait+exchange {float((t2 - t1).mean()) / 1e3:.2f}, store issue {float((t3 - t2).mean()) / 1e3:.2f};"
          f" SMs busy {busy:.0%}; a group's starts spread {spread:.2f} us; last piece loaded -> first release "
          f"{release_lag:.2f} us", flush=True)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(14, 7))
    for a, b, color in ((t0, t1, "tab:blue"), (t1, t2, "tab:red"), (t2, t3, "tab:green")):
        ax.hlines(sm.numpy(), a.numpy() / 1e3, b.numpy() / 1e3, colors=color, linewidth=2)
    ax.set_xlabel("µs (blue: load + sum, red: barrier + exchange, green: stores issue)")
    ax.set_ylabel("SM")
    ax.set_title(f"column_center by hand, pieces {bp}x{rows}, {split} per column block, {warps} warps")
    fig.savefig(os.path.join(out, f"coop_timeline_{bp}x{rows}_w{warps}.png"), dpi=110, bbox_inches="tight")
    plt.close(fig)


def main():
    out = os.environ.get("OUT", ".")
    x = torch.randn(R, C, device="cuda")
    y = torch.empty_like(x)
    for bp, rows, warps in ((32, 1024, 8), (32, 512, 4)):
        split = R // rows
        grid = C // bp * split
        cnt = torch.zeros(C // bp, dtype=torch.int32, device="cuda")
        part = torch.empty(split, C, device="cuda")
        stamps = torch.zeros(grid, 5, dtype=torch.int64, device="cuda")

        def run():
            cnt.zero_()
            timed_center[(grid,)](x, y, cnt, part, stamps, BP=bp, ROWS=rows, SPLIT=split, num_cols=C, num_rows=R,
                                  num_warps=warps)
        t = do_bench(run, warmup=5, rep=50, return_mode="median") * 1e-3
        assert torch.allclose(y, x - x.mean(0, keepdim=True), atol=1e-5)
        print(f"do_bench median {t * 1e6:.1f} us", file=sys.stderr)
        run()
        torch.cuda.synchronize()
        report(stamps, bp, rows, split, warps, out)


if __name__ == "__main__":
    main()
