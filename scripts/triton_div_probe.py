"""Device probe: a generated max-pool backward gather (ceil mode) that differed from the interpreter on an H100
(scripts/kernel_check_probe.py), launched alone on the test's inputs at several warp counts, as generated and
edited. Not a test.

    python scripts/triton_div_probe.py
"""
import torch
import triton
import triton.language as tl


@triton.jit
def gather(in0, in1, out0, WIDE: tl.constexpr, WHAT: tl.constexpr):
    pid_p = tl.program_id(0)
    p = pid_p * 64 + tl.arange(0, 64)[:, None]
    mask_p = p < 48
    lo = 0
    hi = 7
    c3 = (p % 8)
    l0 = lo
    l = l0 + tl.arange(0, 8)[None, :]
    mask_l = l < hi
    c4 = (p // 8)
    c5 = l
    m6 = mask_p & mask_l
    if WHAT == 4:  # loads without the mask (these addresses are all in bounds), the result masked
        x7 = tl.where(m6, tl.load(in0 + c4 * 16 + (c3 // 2) * 4 + (c5 // 2)), 0)
    else:
        x7 = tl.load(in0 + c4 * 16 + (c3 // 2) * 4 + (c5 // 2), mask=m6, other=0)
    if WIDE:
        t8 = (x7 == (7 * c3 + c5).to(tl.int64))
    else:
        t8 = (x7 == (7 * c3 + c5))
    x9 = tl.load(in1 + c4 * 16 + (c3 // 2) * 4 + (c5 // 2), mask=m6, other=0)
    t10 = x9.to(tl.float32)
    t11 = tl.where(t8, t10, (0.0))
    if WHAT == 0 or WHAT == 4:
        tl.store(out0 + p * 7 + c5, t11, mask=m6)
    elif WHAT == 1:  # the gathered gradient alone
        tl.store(out0 + p * 7 + c5, t10, mask=m6)
    elif WHAT == 2:  # the gathered indices alone
        tl.store(out0 + p * 7 + c5, x7.to(tl.float32), mask=m6)
    else:  # the flat position alone
        tl.store(out0 + p * 7 + c5, (7 * c3 + c5).to(tl.float32), mask=m6)


def main():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 7, device="cuda")
    pooled, idx = torch.nn.functional.max_pool2d_with_indices(x, 2, ceil_mode=True)
    g = torch.randn_like(pooled)
    ref = torch.ops.aten.max_pool2d_with_indices_backward(g, x, [2, 2], [2, 2], [0, 0], [1, 1], True, idx)
    p = torch.arange(48, device="cuda")[:, None]
    l = torch.arange(7, device="cuda")[None, :]
    at = ((p // 8) * 16 + (p % 8 // 2) * 4 + l // 2).view(2, 3, 8, 7)
    refs = {0: ref, 1: g.flatten()[at], 2: idx.flatten()[at].float(), 3: (7 * (p % 8) + l).float().view(2, 3, 8, 7)}
    refs[4] = ref
    for what, label in enumerate(("generated", "gradient gathered", "indices gathered", "flat position",
                                  "unmasked index load")):
        for wide in (False, True):
            for warps in (1, 2, 4, 8):
                out = torch.full_like(x, float("nan"))
                gather[(1,)](idx, g, out, wide, what, num_warps=warps)
                bad = (out != refs[what]).sum().item()
                print(f"{label}: int64 compare={wide} num_warps={warps}: {bad} of {out.numel()} wrong", flush=True)
                if bad and not wide and warps == 1:
                    wrong = (out != refs[what]).view(48, 7).nonzero().tolist()
                    print("  wrong (row, col):", wrong)
                    print("  got:", [round(v, 3) for v in out.view(48, 7)[tuple(zip(*wrong))].tolist()])
                    print("  want:", [round(v, 3) for v in refs[what].view(48, 7)[tuple(zip(*wrong))].tolist()])

if __name__ == "__main__":
    main()
