"""Device probe: batch norm's cooperative kernel with pieces that stay in shared memory. Training-mode batch norm on
the bench's 64x256x56x56 fp32 tensor by hand in Gluon. A persistent grid of GROUPS groups of SPLIT programs walks the
channels; a program's piece is NB whole planes (one image's 56x56 of one channel), each one TMA box of [64, 64] over
the view [N*C, 49, 64] (H*W = 49 rows of 64; rows 49-63 lie past the view and arrive as zeros). Pieces live in a ring
of STAGES shared buffers, never in registers: the statistics and the normalisation each loop over the planes as
[64, 64] tiles, so nothing is padded to a power of two in registers and no index tile is held across the barrier.

Partial sums and centred sums of squares (Chan et al.) meet at the channel's counter. EARLY=0 issues the next piece
after the arrival (as the column kernels do); EARLY=1 issues it at the top of the iteration and arrives from warp 1
(a masked tensor atomic), to see whether the arrival's release then still waits for warp 0's TMA copies (it does:
204.6 against 194.7 us on the H100). bn_ahead (EARLY=2) arrives for the next block before storing this one.
Prints do_bench medians against torch's copy. Not a test."""
import itertools

import torch
import torch.nn.functional as F
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.testing import do_bench

N, C, H, W = 64, 256, 56, 56
ROWS, COLS = 49, 64  # a plane of H*W = 3136 as 49 rows of 64


@gluon.jit
def _fetch(x_desc, smem, bar, slot, n0, c, NB: gl.constexpr, C: gl.constexpr):
    mbarrier.expect(bar, NB * 64 * 64 * 4)  # zero-filled rows count
    for i in gl.static_range(NB):
        tma.async_copy_global_to_shared(x_desc, [(n0 + i) * C + c, 0, 0], bar, smem.index(slot * NB + i).reshape([1, 64, 64]))


@gluon.jit
def _affine(sums, m2s, wc, bc, NB: gl.constexpr, SPLIT: gl.constexpr, HW: gl.constexpr):
    """(scale, shift) of one channel from every piece's sum and centred sum of squares (Chan et al.)."""
    mean = gl.sum(sums, axis=0) / (SPLIT * NB * HW)
    spread = sums / (NB * HW) - mean
    var = (gl.sum(m2s, axis=0) + NB * HW * gl.sum(spread * spread, axis=0)) / (SPLIT * NB * HW)
    scale = gl.rsqrt(var + 1e-5) * wc
    return scale, bc - mean * scale


@gluon.jit
def _arrive(ptr, WARP: gl.constexpr, num_warps: gl.constexpr):
    """Add one to *ptr from lane 0 of warp WARP (acq_rel, gpu scope); every thread gets the old value."""
    if WARP == 0:
        old = gl.atomic_add(ptr, 1, sem="acq_rel", scope="gpu")
    else:
        lanes: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        t = gl.arange(0, 32 * num_warps, layout=lanes)
        mine = t == 32 * WARP
        res = gl.atomic_add(ptr + t * 0, mine.to(gl.int32), mask=mine, sem="acq_rel", scope="gpu")
        old = gl.max(gl.where(mine, res, 0), axis=0)
    return old


@gluon.jit
def bn_planes(x_desc, y, w, b, cnt, psum, pm2, base, NB: gl.constexpr, SPLIT: gl.constexpr, GROUPS: gl.constexpr,
              STAGES: gl.constexpr, EARLY: gl.constexpr, C: gl.constexpr, HW: gl.constexpr, num_warps: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [num_warps, 1], [1, 0])
    plane: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    smem = gl.allocate_shared_memory(gl.float32, [STAGES * NB, 64, 64], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(bars.index(st), count=1)
    fence_async_shared()
    pid = gl.program_id(0)
    g = pid // SPLIT
    s = pid % SPLIT
    n0 = s * NB
    for st in gl.static_range(STAGES - 1):
        if g + st * GROUPS < C:
            _fetch(x_desc, smem, bars.index(st), st, n0, g + st * GROUPS, NB, C)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))[:, None]
    q = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))[None, :]
    valid = r < 49
    hw = r * 64 + q
    k = gl.arange(0, SPLIT, layout=plane)
    it = 0
    for c in range(g, C, GROUPS):
        slot = it % STAGES
        ahead = c + (STAGES - 1) * GROUPS
        if EARLY:  # the buffer of the previous block is free: every thread has stored from it
            gl.thread_barrier()
            fence_async_shared()
            if ahead < C:
                _fetch(x_desc, smem, bars.index((it + STAGES - 1) % STAGES), (it + STAGES - 1) % STAGES, n0, ahead,
                       NB, C)
        mbarrier.wait(bars.index(slot), (it // STAGES) & 1)
        acc = gl.zeros([64, 64], gl.float32, layout)
        for i in gl.static_range(NB):
            acc += smem.index(slot * NB + i).load(layout)
        own = gl.sum(gl.sum(acc, axis=1), axis=0)
        mu = own / (NB * HW)
        acc = gl.zeros([64, 64], gl.float32, layout)
        for i in gl.static_range(NB):
            d = gl.where(valid, smem.index(slot * NB + i).load(layout) - mu, 0.0)
            acc += d * d
        gl.store(psum + s * C + c, own)
        gl.store(pm2 + s * C + c, gl.sum(gl.sum(acc, axis=1), axis=0))
        gl.thread_barrier()
        if EARLY:
            arrived = _arrive(cnt + c, 1, num_warps) + 1
        else:
            arrived = _arrive(cnt + c, 0, num_warps) + 1
            gl.thread_barrier()
            fence_async_shared()
            if ahead < C:
                _fetch(x_desc, smem, bars.index((it + STAGES - 1) % STAGES), (it + STAGES - 1) % STAGES, n0, ahead,
                       NB, C)
        while arrived < base + SPLIT:
            arrived = gl.atomic_add(cnt + c, 0, sem="acquire", scope="gpu")
        sums = gl.load(psum + k * C + c, cache_modifier=".cg")
        m2s = gl.load(pm2 + k * C + c, cache_modifier=".cg")
        scale, shift = _affine(sums, m2s, gl.load(w + c), gl.load(b + c), NB, SPLIT, HW)
        for i in gl.static_range(NB):
            v = smem.index(slot * NB + i).load(layout)
            gl.store(y + ((n0 + i) * C + c).to(gl.int64) * HW + hw, v * scale + shift, mask=valid)
        it += 1
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(st))



@gluon.jit
def _plane_stats(smem, slot, valid, layout: gl.constexpr, NB: gl.constexpr, HW: gl.constexpr):
    """The piece's sum and centred sum of squares, from its planes in shared memory."""
    acc = gl.zeros([64, 64], gl.float32, layout)
    for i in gl.static_range(NB):
        acc += smem.index(slot * NB + i).load(layout)
    own = gl.sum(gl.sum(acc, axis=1), axis=0)
    mu = own / (NB * HW)
    acc = gl.zeros([64, 64], gl.float32, layout)
    for i in gl.static_range(NB):
        d = gl.where(valid, smem.index(slot * NB + i).load(layout) - mu, 0.0)
        acc += d * d
    return own, gl.sum(gl.sum(acc, axis=1), axis=0)


@gluon.jit
def bn_ahead(x_desc, y, w, b, cnt, psum, pm2, base, NB: gl.constexpr, SPLIT: gl.constexpr, GROUPS: gl.constexpr,
             STAGES: gl.constexpr, C: gl.constexpr, HW: gl.constexpr, num_warps: gl.constexpr):
    """bn_planes with the next block's statistics published and arrived at before this block's stores, so no
    arrival's release waits for stores or copies in flight: the next piece's copies have landed by then, and the
    stores of the block before had the whole wait to drain."""
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [num_warps, 1], [1, 0])
    plane: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    smem = gl.allocate_shared_memory(gl.float32, [STAGES * NB, 64, 64], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(bars.index(st), count=1)
    fence_async_shared()
    pid = gl.program_id(0)
    g = pid // SPLIT
    s = pid % SPLIT
    n0 = s * NB
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))[:, None]
    q = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))[None, :]
    valid = r < 49
    hw = r * 64 + q
    k = gl.arange(0, SPLIT, layout=plane)
    _fetch(x_desc, smem, bars.index(0), 0, n0, g, NB, C)
    mbarrier.wait(bars.index(0), 0)
    own, m2 = _plane_stats(smem, 0, valid, layout, NB, HW)
    gl.store(psum + s * C + g, own)
    gl.store(pm2 + s * C + g, m2)
    gl.thread_barrier()
    gl.atomic_add(cnt + g, 1, sem="acq_rel", scope="gpu")
    if g + GROUPS < C:
        _fetch(x_desc, smem, bars.index(1 % STAGES), 1 % STAGES, n0, g + GROUPS, NB, C)
    it = 0
    for c in range(g, C, GROUPS):
        slot = it % STAGES
        nxt = c + GROUPS
        if nxt < C:
            nslot = (it + 1) % STAGES
            mbarrier.wait(bars.index(nslot), ((it + 1) // STAGES) & 1)
            own, m2 = _plane_stats(smem, nslot, valid, layout, NB, HW)
            gl.store(psum + s * C + nxt, own)
            gl.store(pm2 + s * C + nxt, m2)
            gl.thread_barrier()
            gl.atomic_add(cnt + nxt, 1, sem="acq_rel", scope="gpu")
            if STAGES > 2:  # the slot of the block before this one: its stores are done
                fence_async_shared()
                if nxt + GROUPS < C:
                    _fetch(x_desc, smem, bars.index((it + 2) % STAGES), (it + 2) % STAGES, n0, nxt + GROUPS, NB, C)
        arrived = gl.atomic_add(cnt + c, 0, sem="acquire", scope="gpu")
        while arrived < base + SPLIT:
            arrived = gl.atomic_add(cnt + c, 0, sem="acquire", scope="gpu")
        sums = gl.load(psum + k * C + c, cache_modifier=".cg")
        m2s = gl.load(pm2 + k * C + c, cache_modifier=".cg")
        scale, shift = _affine(sums, m2s, gl.load(w + c), gl.load(b + c), NB, SPLIT, HW)
        for i in gl.static_range(NB):
            v = smem.index(slot * NB + i).load(layout)
            gl.store(y + ((n0 + i) * C + c).to(gl.int64) * HW + hw, v * scale + shift, mask=valid)
        if STAGES == 2:
            gl.thread_barrier()
            fence_async_shared()
            if nxt + GROUPS < C:
                _fetch(x_desc, smem, bars.index(slot), slot, n0, nxt + GROUPS, NB, C)
        it += 1
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(st))



@gluon.jit
def bn_regs(x_desc, d32, d16, d1, y, w, b, cnt, psum, pm2, base, NB: gl.constexpr, SPLIT: gl.constexpr,
            GROUPS: gl.constexpr, C: gl.constexpr, HW: gl.constexpr, NOBAR: gl.constexpr, EXACT: gl.constexpr,
            num_warps: gl.constexpr, FENCE: gl.constexpr = False):
    """The column kernels' shape for batch norm: the current piece in registers as one [NB, 64, 64] tile (rows
    49-63 of each plane masked), the next one streaming into shared memory, issued right after the arrival.
    NOBAR: no wait (each piece normalised by its own statistics: the access pattern's ceiling). EXACT: each plane
    as boxes of 32, 16 and 1 rows, all in bounds (no zero fill; rows 49-63 of the buffer hold stale values)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 2, 16], [1, num_warps, 1], [2, 1, 0])
    plane: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    smem = gl.allocate_shared_memory(gl.float32, [NB, 64, 64], x_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    fence_async_shared()
    pid = gl.program_id(0)
    g = pid // SPLIT
    s = pid % SPLIT
    n0 = s * NB
    _fetch3(x_desc, d32, d16, d1, smem, bar, n0, g, NB, C, EXACT)
    i = gl.arange(0, NB, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))[:, None, None]
    r = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))[None, :, None]
    q = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))[None, None, :]
    valid = r < 49
    k = gl.arange(0, SPLIT, layout=plane)
    it = 0
    for c in range(g, C, GROUPS):
        mbarrier.wait(bar, it & 1)
        v = smem.load(layout)
        gl.thread_barrier()
        fence_async_shared()
        if EXACT:
            v = gl.where(valid, v, 0.0)
        own = gl.sum(gl.sum(gl.sum(v, axis=2), axis=1), axis=0)
        d = gl.where(valid, v - own / (NB * HW), 0.0)
        gl.store(psum + s * C + c, own)
        gl.store(pm2 + s * C + c, gl.sum(gl.sum(gl.sum(d * d, axis=2), axis=1), axis=0))
        if FENCE:  # every thread fences its partials; the next piece goes out before a relaxed arrival
            gl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
            gl.thread_barrier()
            if c + GROUPS < C:
                _fetch3(x_desc, d32, d16, d1, smem, bar, n0, c + GROUPS, NB, C, EXACT)
            arrived = gl.atomic_add(cnt + c, 1, sem="relaxed", scope="gpu") + 1
        else:
            gl.thread_barrier()
            arrived = gl.atomic_add(cnt + c, 1, sem="acq_rel", scope="gpu") + 1
            if c + GROUPS < C:
                _fetch3(x_desc, d32, d16, d1, smem, bar, n0, c + GROUPS, NB, C, EXACT)
        if NOBAR:
            sums = gl.load(psum + s * C + c + k * 0)
            m2s = gl.load(pm2 + s * C + c + k * 0) / SPLIT
        else:
            while arrived < base + SPLIT:
                arrived = gl.atomic_add(cnt + c, 0, sem="acquire", scope="gpu")
            sums = gl.load(psum + k * C + c, cache_modifier=".cg")
            m2s = gl.load(pm2 + k * C + c, cache_modifier=".cg")
        scale, shift = _affine(sums, m2s, gl.load(w + c), gl.load(b + c), NB, SPLIT, HW)
        at = i * (C * HW) + r * 64 + q  # int32 within the piece; the piece's base in 64 bits
        gl.store(y + (n0 * C + c).to(gl.int64) * HW + at, v * scale + shift, mask=valid)
        it += 1
    mbarrier.invalidate(bar)


@gluon.jit
def _fetch3(x_desc, d32, d16, d1, smem, bar, n0, c, NB: gl.constexpr, C: gl.constexpr, EXACT: gl.constexpr):
    if EXACT:
        mbarrier.expect(bar, NB * 49 * 64 * 4)
        for i in gl.static_range(NB):
            dst = smem.slice(i, 1)
            tma.async_copy_global_to_shared(d32, [(n0 + i) * C + c, 0, 0], bar, dst.slice(0, 32, dim=1))
            tma.async_copy_global_to_shared(d16, [(n0 + i) * C + c, 32, 0], bar, dst.slice(32, 16, dim=1))
            tma.async_copy_global_to_shared(d1, [(n0 + i) * C + c, 48, 0], bar, dst.slice(48, 1, dim=1))
    else:
        mbarrier.expect(bar, NB * 64 * 64 * 4)  # zero-filled rows count
        for i in gl.static_range(NB):
            tma.async_copy_global_to_shared(x_desc, [(n0 + i) * C + c, 0, 0], bar, smem.slice(i, 1))


def main():
    x = torch.randn(N, C, H, W, device="cuda")
    w, b = torch.rand(C, device="cuda") + 0.5, torch.randn(C, device="cuda")
    y = torch.empty_like(x)
    copy = do_bench(lambda: y.copy_(x), warmup=5, rep=50, return_mode="median") * 1e-3
    floor = 2 * x.numel() * 4
    print(f"torch copy {copy * 1e6:.1f} us ({floor / copy / 1e12:.2f} TB/s)", flush=True)
    ref = F.batch_norm(x, None, None, w, b, training=True, eps=1e-5)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)  # rank 2 also types the planes
    desc = TensorDescriptor.from_tensor(x.view(N * C, ROWS, COLS), [1, 64, 64], layout)
    l3 = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
    desc3, d32, d16, d1 = (TensorDescriptor.from_tensor(x.view(N * C, ROWS, COLS), [1, rows, 64], l3)
                           for rows in (64, 32, 16, 1))
    cnt = torch.zeros(C, dtype=torch.int32, device="cuda")
    for (nb, stages, warps, per_sm), early in itertools.product(
            ((8, 1, 8, 1), (4, 1, 4, 2)), (3, 7)):  # bn_regs: 3, 4 no barrier, 5 exact boxes, 6 both, 7 fenced
        split = N // nb
        groups = min(C, sms * per_sm // split)
        psum, pm2 = torch.empty(split, C, device="cuda"), torch.empty(split, C, device="cuda")
        calls = [0]

        def run():
            cnt.zero_() if calls[0] == 0 else None
            base = calls[0] * split
            calls[0] += 1
            if early >= 3:
                bn_regs[(groups * split,)](desc3, d32, d16, d1, y, w, b, cnt, psum, pm2, base, NB=nb, SPLIT=split,
                                           GROUPS=groups, C=C, HW=H * W, NOBAR=early in (4, 6),
                                           EXACT=early in (5, 6), num_warps=warps, FENCE=early == 7)
            elif early == 2:
                bn_ahead[(groups * split,)](desc, y, w, b, cnt, psum, pm2, base, NB=nb, SPLIT=split, GROUPS=groups,
                                            STAGES=stages, C=C, HW=H * W, num_warps=warps)
            else:
                bn_planes[(groups * split,)](desc, y, w, b, cnt, psum, pm2, base, NB=nb, SPLIT=split, GROUPS=groups,
                                             STAGES=stages, EARLY=early, C=C, HW=H * W, num_warps=warps)
        try:
            y.zero_()
            run()
            err = (y - ref).abs().max().item() if early not in (4, 6) else float("nan")
            t = do_bench(run, warmup=5, rep=50, return_mode="median") * 1e-3
        except Exception as exc:  # noqa: BLE001 - a probe reports and goes on
            print(f"nb {nb} s{stages} w{warps} x{per_sm} early {early}: {type(exc).__name__}: {str(exc)[:300]}",
                  flush=True)
            cnt.zero_()
            calls[0] = 0
            continue
        cnt.zero_()
        print(f"batch norm, planes in shared memory: {groups} groups of {split}, {nb} planes per piece, ring of "
              f"{stages}, w{warps}, early {early}: {t * 1e6:.1f} us, {copy / t:.0%} of copy, max error {err:.1e}",
              flush=True)


if __name__ == "__main__":
    main()
