"""Device probe: does streaming the next piece into shared memory by TMA lift batch norm's cooperative kernel the
way it lifted the column patterns? Training-mode batch norm on the bench's 64x256x56x56 fp32 tensor by hand in Gluon:
a persistent grid of GROUPS groups of SPLIT programs walks the channels; a program's piece is NB images of one
channel, NB*13 TMA boxes of 256 elements (the 2-D view [N*C, H*W], the last box of a row zero-filled past H*W) into a
[R, 256] shared buffer, read as one [1, R*256] register tile whose lanes past the piece are masked. Partial sums and
centred sums of squares (Chan et al.) meet at the channel's counter; the next piece is issued after the arrival.
Prints do_bench medians against torch's copy and the bench's stitchflow time. Not a test."""
import sys

import torch
import torch.nn.functional as F
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.testing import do_bench

N, C, HW = 64, 256, 56 * 56
BOX = gl.constexpr(256)


@gluon.jit
def _fetch(x_desc, smem, bar, n0, c, NB: gl.constexpr, BOXES: gl.constexpr, C: gl.constexpr):
    mbarrier.expect(bar, NB * BOXES * BOX * 4)
    for r in gl.static_range(NB * BOXES):
        tma.async_copy_global_to_shared(x_desc, [(n0 + r // BOXES) * C + c, (r % BOXES) * BOX], bar, smem.slice(r, 1))


@gluon.jit
def bn_tma(x_desc, y, w, b, cnt, psum, pm2, NB: gl.constexpr, SPLIT: gl.constexpr, GROUPS: gl.constexpr,
           C: gl.constexpr, HW: gl.constexpr, BOXES: gl.constexpr, R: gl.constexpr, num_warps: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, num_warps], [1, 0])
    plane: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    smem = gl.allocate_shared_memory(gl.float32, [R, BOX], x_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    fence_async_shared()
    pid = gl.program_id(0)
    g = pid // SPLIT
    s = pid % SPLIT
    n0 = s * NB
    _fetch(x_desc, smem, bar, n0, g, NB, BOXES, C)
    j = gl.arange(0, R * BOX, layout=gl.SliceLayout(0, layout))[None, :]
    row = j // BOX
    hw = (row % BOXES) * BOX + j % BOX
    valid = (row < NB * BOXES) & (hw < HW)
    at = (n0 + row // BOXES) * (C * HW) + hw
    k = gl.arange(0, SPLIT, layout=plane)
    it = 0
    for c in range(g, C, GROUPS):
        mbarrier.wait(bar, it & 1)
        v = smem.reshape([1, R * BOX]).load(layout)
        gl.thread_barrier()
        fence_async_shared()
        v = gl.where(valid, v, 0.0)
        own = gl.sum(gl.sum(v, axis=1), axis=0)
        mu = own / (NB * HW)
        d = gl.where(valid, v - mu, 0.0)
        gl.store(psum + s * C + c, own)
        gl.store(pm2 + s * C + c, gl.sum(gl.sum(d * d, axis=1), axis=0))
        gl.thread_barrier()
        arrived = gl.atomic_add(cnt + c, 1, sem="acq_rel", scope="gpu") + 1
        if c + GROUPS < C:
            _fetch(x_desc, smem, bar, n0, c + GROUPS, NB, BOXES, C)
        while arrived < SPLIT:
            arrived = gl.atomic_add(cnt + c, 0, sem="acquire", scope="gpu")
        sums = gl.load(psum + k * C + c, cache_modifier=".cg")
        m2s = gl.load(pm2 + k * C + c, cache_modifier=".cg")
        mean = gl.sum(sums, axis=0) / (SPLIT * NB * HW)
        spread = sums / (NB * HW) - mean
        var = (gl.sum(m2s, axis=0) + NB * HW * gl.sum(spread * spread, axis=0)) / (SPLIT * NB * HW)
        scale = gl.rsqrt(var + 1e-5) * gl.load(w + c)
        gl.store(y + at + c * HW, (v - mean) * scale + gl.load(b + c), mask=valid)
        it += 1
    mbarrier.invalidate(bar)


def main():
    x = torch.randn(N, C, 56, 56, device="cuda")
    w, b = torch.rand(C, device="cuda") + 0.5, torch.randn(C, device="cuda")
    y = torch.empty_like(x)
    copy = do_bench(lambda: y.copy_(x), warmup=5, rep=50, return_mode="median") * 1e-3
    floor = 2 * x.numel() * 4
    print(f"torch copy {copy * 1e6:.1f} us ({floor / copy / 1e12:.2f} TB/s)", flush=True)
    ref = F.batch_norm(x, None, None, w, b, training=True, eps=1e-5)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    desc = TensorDescriptor.from_tensor(x.view(N * C, HW), [1, BOX.value], layout)
    for nb, r, warps, per_sm in ((2, 32, 4, 2), (1, 16, 4, 2), (1, 16, 4, 3), (1, 16, 4, 4), (4, 64, 8, 1)):
        split = N // nb
        groups = min(C, sms * per_sm // split)
        cnt = torch.zeros(C, dtype=torch.int32, device="cuda")
        psum, pm2 = torch.empty(split, C, device="cuda"), torch.empty(split, C, device="cuda")

        def run():
            cnt.zero_()
            bn_tma[(groups * split,)](desc, y, w, b, cnt, psum, pm2, NB=nb, SPLIT=split, GROUPS=groups, C=C, HW=HW,
                                      BOXES=-(-HW // BOX.value), R=r, num_warps=warps)
        try:
            t = do_bench(run, warmup=5, rep=50, return_mode="median") * 1e-3
        except Exception as exc:  # noqa: BLE001 - a probe reports and goes on
            print(f"nb {nb} w{warps} x{per_sm}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        err = (y - ref).abs().max().item()
        print(f"batch norm TMA-prefetched, {groups} groups of {split}, {nb} images per piece, w{warps}: "
              f"{t * 1e6:.1f} us, {copy / t:.0%} of copy, max error {err:.1e}", flush=True)
    if "--compile" in sys.argv:
        fn = torch.compile(lambda x: F.batch_norm(x, None, None, w, b, training=True, eps=1e-5))
        fn(x)
        t = do_bench(lambda: fn(x), warmup=5, rep=50, return_mode="median") * 1e-3
        print(f"torch.compile {t * 1e6:.1f} us, {copy / t:.0%} of copy")


if __name__ == "__main__":
    main()
