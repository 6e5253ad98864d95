"""Device probe: column_center / column_standardize (65536x1024 fp32, statistics over the rows) with pieces two
32-column halves wide, so that DRAM sees 256 contiguous bytes of every row a piece touches (the access pattern alone
runs at 94-95% of copy with 64 columns, 87-88% with 32), and with cheaper statistics:

- shifted sums: every program of a column block sums d = x - K and d*d, where K is the column's value in row 0
  (loaded with the piece), so both reductions are independent (no piece mean before the centred sum of squares)
  and the group's partials combine by adding: mean = K + sum(d)/N, var = sum(d*d)/N - (sum(d)/N)^2. K is a sample
  of the column, so |mean - K| is of the order of the spread and little cancels;
- ATOMIC: the partials added into one accumulator per block and call (`red.global.add`) instead of one row per
  program read back and summed after the barrier.

A persistent grid of GROUPS groups of SPLIT programs walks the column blocks; each piece arrives by TMA (both halves'
boxes issued back to back), moves to registers, the program publishes its partials, arrives at the block's counter,
issues the next piece's copies, waits, combines and stores from registers. NOBAR: each piece normalised by its own
statistics (the access pattern alone, wrong on purpose). Also times the generated kernels in the same process.
Not a test.

    python scripts/column_wide_probe.py
"""
import dataclasses

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.testing import do_bench

R, C = 65536, 1024
BOX = gl.constexpr(256)  # TMA box rows (at most 256)
HALF = gl.constexpr(32)  # a half's columns: a 128-byte swizzled box row


@gluon.jit
def _fetch(x_desc, smem, bar, row0, blk, HALVES: gl.constexpr, ROWS: gl.constexpr):
    mbarrier.expect(bar, HALVES * ROWS * HALF * 4)
    for b in gl.static_range(ROWS // BOX):
        for h in gl.static_range(HALVES):  # a row's halves back to back: 256 contiguous bytes
            tma.async_copy_global_to_shared(x_desc, [row0 + b * BOX, blk * (HALVES * HALF) + h * HALF], bar,
                                            smem.slice(h * ROWS + b * BOX, BOX))


@gluon.jit
def _partials(v, k, STD: gl.constexpr):
    d = v - k[None, :]
    s1 = gl.sum(d, axis=0)
    if STD:
        s2 = gl.sum(d * d, axis=0)
    else:
        s2 = s1
    return s1, s2


@gluon.jit
def _publish(s1, s2, part, part2, acc, acc2, s, call, col0, plane1: gl.constexpr, STD: gl.constexpr,
             ATOMIC: gl.constexpr, num_cols: gl.constexpr):
    c = col0 + gl.arange(0, HALF, layout=plane1)
    s1 = gl.convert_layout(s1, plane1)
    s2 = gl.convert_layout(s2, plane1)
    if ATOMIC:
        gl.atomic_add(acc + call * num_cols + c, s1, sem="relaxed", scope="gpu")
        if STD:
            gl.atomic_add(acc2 + call * num_cols + c, s2, sem="relaxed", scope="gpu")
    else:
        gl.store(part + s * num_cols + c, s1)
        if STD:
            gl.store(part2 + s * num_cols + c, s2)


@gluon.jit
def _own_rstd(s2, off, ROWS: gl.constexpr, STD: gl.constexpr):
    if STD:
        r = gl.rsqrt(gl.maximum(s2 * (1.0 / ROWS) - off * off, 0.0) + 1e-5)
    else:
        r = off * 0.0 + 1.0
    return r


@gluon.jit
def _combine(part, part2, acc, acc2, call, col0, k, layout: gl.constexpr, plane: gl.constexpr, SPLIT: gl.constexpr,
             STD: gl.constexpr, ATOMIC: gl.constexpr, num_cols: gl.constexpr, num_rows: gl.constexpr):
    """(mean, 1/std) of the block's columns col0..col0+31, in the register tile's column layout."""
    if ATOMIC:
        c = col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
        t1 = gl.load(acc + call * num_cols + c, cache_modifier=".cg")
        if STD:
            t2 = gl.load(acc2 + call * num_cols + c, cache_modifier=".cg")
    else:
        kk = gl.arange(0, SPLIT, layout=gl.SliceLayout(1, plane))[:, None]
        kc = col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, plane))[None, :]
        p1 = gl.load(part + kk * num_cols + kc, cache_modifier=".cg")
        if STD:
            p2 = gl.load(part2 + kk * num_cols + kc, cache_modifier=".cg")
            t2 = gl.convert_layout(gl.sum(p2, axis=0), gl.SliceLayout(0, layout))
        t1 = gl.convert_layout(gl.sum(p1, axis=0), gl.SliceLayout(0, layout))
    off = t1 * (1.0 / num_rows)
    if STD:
        rstd = gl.rsqrt(gl.maximum(t2 * (1.0 / num_rows) - off * off, 0.0) + 1e-5)
    else:
        rstd = off * 0.0 + 1.0
    return k + off, rstd


@gluon.jit
def column_wide(x_desc, x, y, cnt, part, part2, acc, acc2, base, call, HALVES: gl.constexpr, ROWS: gl.constexpr,
                SPLIT: gl.constexpr, GROUPS: gl.constexpr, STD: gl.constexpr, ATOMIC: gl.constexpr,
                NOBAR: gl.constexpr, num_cols: gl.constexpr, num_rows: gl.constexpr, num_warps: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])
    plane: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [num_warps, 1], [1, 0])
    plane1: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    BP: gl.constexpr = HALVES * HALF
    nblk: gl.constexpr = num_cols // BP
    smem = gl.allocate_shared_memory(gl.float32, [HALVES * ROWS, HALF], x_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    fence_async_shared()
    pid = gl.program_id(0)
    g = pid // SPLIT
    s = pid % SPLIT
    row0 = s * ROWS
    _fetch(x_desc, smem, bar, row0, g, HALVES, ROWS)
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))[:, None]
    c32 = gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
    it = 0
    for blk in range(g, nblk, GROUPS):
        col0 = blk * BP
        if STD:  # the shift: each column's value in row 0 (one line, read while the piece lands)
            k0 = gl.load(x + col0 + c32)
            if HALVES == 2:
                k1 = gl.load(x + col0 + HALF + c32)
        else:
            k0 = c32 * 0.0
            k1 = k0
        mbarrier.wait(bar, it & 1)
        v0 = smem.slice(0, ROWS).load(layout)
        if HALVES == 2:
            v1 = smem.slice(ROWS, ROWS).load(layout)
        gl.thread_barrier()  # every warp holds its share of the piece: the buffer may refill
        fence_async_shared()
        nxt = blk + GROUPS
        a0, b0 = _partials(v0, k0, STD)
        if HALVES == 2:
            a1, b1 = _partials(v1, k1, STD)
        if NOBAR:
            if nxt < nblk:
                _fetch(x_desc, smem, bar, row0, nxt, HALVES, ROWS)
            off0 = a0 * (1.0 / ROWS)
            mean0 = k0 + off0
            rstd0 = _own_rstd(b0, off0, ROWS, STD)
            if HALVES == 2:
                off1 = a1 * (1.0 / ROWS)
                mean1 = k1 + off1
                rstd1 = _own_rstd(b1, off1, ROWS, STD)
        else:
            _publish(a0, b0, part, part2, acc, acc2, s, call, col0, plane1, STD, ATOMIC, num_cols)
            if HALVES == 2:
                _publish(a1, b1, part, part2, acc, acc2, s, call, col0 + HALF, plane1, STD, ATOMIC, num_cols)
            gl.thread_barrier()
            arrived = gl.atomic_add(cnt + blk, 1, sem="acq_rel", scope="gpu") + 1
            if nxt < nblk:
                _fetch(x_desc, smem, bar, row0, nxt, HALVES, ROWS)
            while arrived < base + SPLIT:
                arrived = gl.atomic_add(cnt + blk, 0, sem="acquire", scope="gpu")
            mean0, rstd0 = _combine(part, part2, acc, acc2, call, col0, k0, layout, plane, SPLIT, STD, ATOMIC,
                                    num_cols, num_rows)
            if HALVES == 2:
                mean1, rstd1 = _combine(part, part2, acc, acc2, call, col0 + HALF, k1, layout, plane, SPLIT, STD,
                                        ATOMIC, num_cols, num_rows)
        gl.store(y + rows * num_cols + col0 + c32[None, :], (v0 - mean0[None, :]) * rstd0[None, :])
        if HALVES == 2:
            gl.store(y + rows * num_cols + col0 + HALF + c32[None, :], (v1 - mean1[None, :]) * rstd1[None, :])
        it += 1
    mbarrier.invalidate(bar)


@dataclasses.dataclass(frozen=True)
class Setup:
    halves: int
    rows: int
    warps: int = 8
    per_sm: int = 1

    def __str__(self):
        return f"{32 * self.halves}x{self.rows} w{self.warps}" + (f" x{self.per_sm}/SM" if self.per_sm > 1 else "")


SETUPS = (Setup(1, 1024), Setup(2, 512), Setup(2, 256, 4, 2), Setup(1, 512, 4, 2), Setup(1, 1024, 16),
          Setup(2, 512, 16), Setup(2, 256, 8, 2))
CALLS = 4096  # accumulators per call (zeroed once): a real kernel would zero the other launch parity's


def time_hand(x, y, copy, sms):
    for st in SETUPS:  # noqa: F821 - set in main
        split = R // st.rows
        groups = max(1, sms * st.per_sm // split)
        layout = gl.NVMMASharedLayout.get_default_for([BOX.value, HALF.value], gl.float32)
        desc = TensorDescriptor.from_tensor(x, [BOX.value, HALF.value], layout)
        nblk = C // (32 * st.halves)
        part, part2 = torch.empty(split, C, device="cuda"), torch.empty(split, C, device="cuda")
        for std in (False, True):
            ref = x - x.mean(0, keepdim=True)
            if std:
                ref = ref * torch.rsqrt(x.var(0, unbiased=False, keepdim=True) + 1e-5)
            for atomic, nobar in ((False, True), (False, False), (True, False)):
                cnt = torch.zeros(nblk, dtype=torch.int32, device="cuda")
                acc, acc2 = torch.zeros(CALLS, C, device="cuda"), torch.zeros(CALLS, C, device="cuda")
                calls = [0]

                def run():
                    call = calls[0] % CALLS
                    if call == 0 and calls[0]:
                        acc.zero_(), acc2.zero_()
                    column_wide[(groups * split,)](desc, x, y, cnt, part, part2, acc, acc2, calls[0] * split, call,
                                                   HALVES=st.halves, ROWS=st.rows, SPLIT=split, GROUPS=groups,
                                                   STD=std, ATOMIC=atomic, NOBAR=nobar, num_cols=C, num_rows=R,
                                                   num_warps=st.warps, launch_cooperative_grid=True)
                    calls[0] += 1
                label = (f"{'standardize' if std else 'center'} {st}, {groups} group(s) of {split}, "
                         f"{'own statistics' if nobar else 'atomic sums' if atomic else 'partials'}")
                try:
                    run()
                    err = (y - ref).abs().max().item()
                    t = do_bench(run, warmup=5, rep=100, return_mode="median") * 1e-3
                except Exception as exc:  # noqa: BLE001 - a probe reports and goes on
                    print(f"{label}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
                    continue
                print(f"{label}: {t * 1e6:.1f} us, {copy / t:.1%} of copy, max error {err:.1e}", flush=True)


def generated_column(name: str, rows: int = R):
    """(kernel, spec, env) of the generated TMA-fed kernel of a column pattern at rows x C in the bench's config:
    groups of 1024-row pieces filling the GPU's first 128 SMs."""
    from stitchflow.bench.stitching_patterns import PATTERNS, pattern_kernel
    from stitchflow.targets.gpu.codegen import build_kernel
    from stitchflow.targets.gpu.mapping import Config

    k, strides = pattern_kernel(name, (rows, C))
    split = rows // 1024
    cfg = Config(32, 1024, split, 8, persistent=128 // split * split, coop=True, tma=True)
    spec = build_kernel(k.graph, [(k.plans[0], cfg)], strides, False, k.title, k.group_names)
    args = PATTERNS[name].make((rows, C), torch.float32, "cuda", torch.Generator().manual_seed(0))
    return k, spec, dict(zip(k.inputs, args if isinstance(args, tuple) else (args,)))


def time_generated():
    from stitchflow.targets.gpu.runtime import Launch

    for name in ("column_center", "column_standardize"):
        k, spec, env = generated_column(name)
        launch = Launch(k.graph, spec, name)
        t = do_bench(lambda: launch(env), warmup=5, rep=100, return_mode="median")
        print(f"generated {name}: {t * 1e3:.1f} us", flush=True)


def main():
    import sys
    global SETUPS
    if "--only" in sys.argv:  # --only 4,5,6: those setups
        SETUPS = tuple(SETUPS[int(i)] for i in sys.argv[sys.argv.index("--only") + 1].split(","))
    x = torch.randn(R, C, device="cuda") * 0.5 + 3.0
    y = torch.empty_like(x)
    copy = do_bench(lambda: y.copy_(x), warmup=5, rep=50, return_mode="median") * 1e-3
    print(f"torch copy {copy * 1e6:.1f} us ({2 * x.numel() * 4 / copy / 1e12:.2f} TB/s)", flush=True)
    time_generated()
    time_hand(x, y, copy, torch.cuda.get_device_properties(0).multi_processor_count)
    time_generated()


if __name__ == "__main__":
    main()
