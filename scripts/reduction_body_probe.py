"""Device probe: does the work inside the generated column kernels' reductions matter? column_center and
column_standardize (65536x1024 fp32, the bench's config), each generated source against edited copies:

- "scale after the sum": mean = sum_k(x * 1/N) summed first and scaled once (the IR's mean is a sum of scaled
  elements, one multiply per element);
- "shifted piece variance" (standardize): the piece's centred sum of squares as S2 - S1^2/n over d = x - K, K the
  piece's first row (loaded before the piece lands), so both reductions run at once instead of one after the other;
- "shifted, single use" and "shifted, one tree" (standardize): the same sums with d formed separately for each (a d
  used by both reductions stays live beside the piece and spilled), as two sums or as one two-value reduction
  (one shuffle tree and one shared-memory round for both); each with K loaded from global memory before the piece
  lands, or a block ahead (loaded with the partials after the barrier);
- "one combine tree" (standardize): after the barrier, the partials' two sums (mean; centred squares with the spread
  about piece 0's mean) as one two-value reduction, one cross-warp round instead of two.

Every variant is checked against eager and timed in rounds (the variants in turn). Not a test.

    python scripts/reduction_body_probe.py
"""
import dataclasses
import re
import statistics

import torch

from stitchflow.bench.stitching_patterns import PATTERNS, pattern_kernel
from stitchflow.targets.gpu.codegen import build_kernel
from stitchflow.targets.gpu.mapping import Config
from stitchflow.targets.gpu.runtime import Launch
from stitchflow.targets.gpu.timing import timed_median

R, C = 65536, 1024
SCALED_SUM = """        t4 = (x3 * (1.52587890625e-05))
        b5 = t4.to(gl.float32)
        r6 = gl.sum(b5, axis=1, keep_dims=True)
"""
SUM_THEN_SCALE = """        r6 = gl.sum(x3, axis=1, keep_dims=True) * (1.52587890625e-05)
"""
PIECE_VARIANCE = """        n7 = gl.maximum(hi - lo, 1)
        mu8 = r6 * (65536 / n7)
        # mean_1: about this piece's mean, corrected at the combine (Chan et al.)
        t9 = (x3 - mu8)
        v10 = t9.to(gl.float32)
        t11 = (v10 * v10)
        v12 = t11.to(gl.float32)
        t13 = (v12 * (1.52587890625e-05))
        b14 = t13.to(gl.float32)
        r15 = gl.sum(b14, axis=1, keep_dims=True)
"""
SHIFTED = """        d9 = x3 - k0
        s1 = gl.sum(d9, axis=1, keep_dims=True)
        s2 = gl.sum(d9 * d9, axis=1, keep_dims=True)
        r6 = (s1 + 1024.0 * k0) * (1.52587890625e-05)
        gl.store(buf0 + pid_s * 1024 + p, r6)
        r15 = gl.maximum(s2 - s1 * s1 * (1.0 / 1024), 0.0) * (1.52587890625e-05)
"""
SINGLE_USE = """        s1 = gl.sum(x3 - k0, axis=1, keep_dims=True)
        s2 = gl.sum((k0 - x3) * (k0 - x3), axis=1, keep_dims=True)
""" + SHIFTED.split("\n", 3)[3]
ONE_TREE = """        s1, s2 = gl.reduce((x3 - k0, (k0 - x3) * (k0 - x3)), 1, _add_pairs, keep_dims=True)
""" + SHIFTED.split("\n", 3)[3]
ADD_PAIRS = """
@gluon.jit
def _add_pairs(a1, a2, b1, b2):
    return a1 + b1, a2 + b2

@gluon.jit
def _part0("""
WAIT = "        mbarrier.wait(bar, it & 1)\n"
WAIT_K = "        k0 = gl.load(in0 + lo * 1024 + p)\n" + WAIT
COLUMNS = "gl.arange(0, 32, layout=gl.SliceLayout(1, LAYOUT))[:, None]"
FIRST_K_AT = "    it = 0\n"
FIRST_K = f"    k0 = gl.load(in0 + lo * 1024 + grp * 32 + {COLUMNS})\n"
SPIN = "            arrived = gl.atomic_add(buf2_rows_arrived + pid_p, 0, sem='acquire', scope='gpu')\n"
NEXT_K = (f"        k_next = gl.load(in0 + lo * 1024 + (pid_p + 2) * 32 + {COLUMNS}, "
          f"mask=(pid_p + 2) * 32 + {COLUMNS} < 1024, other=0.0)\n")
LOOP_END = "        it += 1\n"


def one_combine_tree(src: str) -> str:
    """The mean's sum over the partials and the variance's (independent of it: the spread is about piece 0's mean)
    as one two-value reduction: one cross-warp round after the barrier instead of two."""
    mean_sum = re.search(r"        (r\d+) = gl.sum\((parts\d+), axis=1, keep_dims=True\)\n"
                         r"        (v\d+) = \1.to\(gl.float32\)\n", src)
    var_sum = re.search(r"        (r\d+) = gl.sum\((parts\d+ \+ [^\n]*), axis=1, keep_dims=True\)\n", src)
    assert mean_sum and var_sum, "the generated combine changed: update the probe"
    (r_mean, parts, v_mean), (r_var, terms) = mean_sum.groups(), var_sum.groups()
    src = src.replace(mean_sum.group(0), "")
    return src.replace(var_sum.group(0), f"        {r_mean}, {r_var} = gl.reduce(({parts}, {terms}), 1, _add_pairs, "
                                         f"keep_dims=True)\n        {v_mean} = {r_mean}.to(gl.float32)\n")


def variants(name: str, src: str) -> dict:
    out = {"generated": src}
    assert SCALED_SUM in src, "the generated mean changed: update the probe"
    out["scale after the sum"] = src.replace(SCALED_SUM, SUM_THEN_SCALE)
    if name == "column_standardize":
        assert PIECE_VARIANCE in src
        shifted = src.replace(SCALED_SUM + "        gl.store(buf0 + pid_s * 1024 + p, r6)\n" + PIECE_VARIANCE,
                              SHIFTED)
        # K: the piece's first row, read (from L2 or DRAM) while the piece lands
        out["shifted piece variance"] = shifted.replace(WAIT, WAIT_K)
        for label, body in (("shifted, single use", SINGLE_USE), ("shifted, one tree", ONE_TREE)):
            edited = out["shifted piece variance"].replace(SHIFTED, body)
            out[label] = edited.replace("\n@gluon.jit\ndef _part0(", ADD_PAIRS, 1)
            # K loaded a block ahead, with the partials after the barrier: a load issued just before the wait
            # queues behind the previous block's stores, and the swizzled piece in shared memory cannot be sliced
            ahead = shifted.replace(WAIT_K, WAIT).replace(SHIFTED, body).replace(FIRST_K_AT, FIRST_K + FIRST_K_AT)
            ahead = ahead.replace(SPIN, SPIN + NEXT_K).replace(LOOP_END, LOOP_END + "        k0 = k_next\n")
            out[label + ", K a block ahead"] = ahead.replace("\n@gluon.jit\ndef _part0(", ADD_PAIRS, 1)
        out["one combine tree"] = one_combine_tree(src).replace("\n@gluon.jit\ndef _part0(", ADD_PAIRS, 1)
        out["one combine tree, K a block ahead"] = one_combine_tree(out["shifted, single use, K a block ahead"])
    return out


def main():
    cfg = Config(32, 1024, 64, 8, persistent=128, coop=True, tma=True)
    for name in ("column_center", "column_standardize"):
        k, strides = pattern_kernel(name, (R, C))
        spec = build_kernel(k.graph, [(k.plans[0], cfg)], strides, False, k.title, k.group_names)
        args = PATTERNS[name].make((R, C), torch.float32, "cuda", torch.Generator().manual_seed(0))
        env = dict(zip(k.inputs, args if isinstance(args, tuple) else (args,)))
        ref = PATTERNS[name].module()(*env.values())
        launches = {}
        for label, src in variants(name, spec.source).items():
            launch = Launch(k.graph, dataclasses.replace(spec, source=src), f"{name}:{label}")
            launch(env)
            err = ((env[spec.outputs[0]] - ref).norm() / ref.norm()).item()
            print(f"{name} {label}: relative error {err:.1e}", flush=True)
            launches[label] = launch
        times = {label: [] for label in launches}
        for _ in range(3):
            for label, launch in launches.items():
                times[label].append(timed_median(lambda: launch(env), budget_s=0.1) * 1e6)
        for label, ts in times.items():
            print(f"{name} {label}: {statistics.median(ts):.1f} us (rounds {', '.join(f'{t:.1f}' for t in ts)})",
                  flush=True)


if __name__ == "__main__":
    main()
