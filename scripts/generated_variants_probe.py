"""Device probe: which part of a generated cooperative kernel costs the time? Builds the generated Gluon kernel of a
stitching pattern for one config, derives variants by editing its source (each drops or moves one piece of work;
results may be wrong on purpose), and times every variant with do_bench on the same input through runtime.Launch.

    python scripts/generated_variants_probe.py [pattern]

Not a test."""
import dataclasses
import re
import sys

import torch
from triton.testing import do_bench

from stitchflow.bench.stitching_patterns import PATTERNS, pattern_kernel
from stitchflow.targets.gpu.codegen import build_kernel
from stitchflow.targets.gpu.mapping import Config
from stitchflow.targets.gpu.runtime import Launch
from stitchflow.targets.gpu.timing import timed_median

SETUPS = {
    "column_standardize": ((65536, 1024), Config(32, 1024, 64, 8, persistent=128, coop=True, tma=True)),
    "column_center": ((65536, 1024), Config(32, 1024, 64, 8, persistent=128, coop=True, tma=True)),
    "batchnorm_train": ((64, 256, 56, 56), Config(1, 32768, 8, 8, persistent=128, coop=True, tma=True)),
}

FENCE = '''

@gluon.jit
def _fence_acq_rel():
    gl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

'''

PREFETCH = '''

@gluon.jit
def _prefetch_l2(ptr, pred):
    gl.inline_asm_elementwise("{ .reg .pred q; setp.ne.b32 q, $2, 0; @q prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [ptr, pred.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)

'''


def variants(src: str) -> dict:
    out = {"generated": src}
    # the piece's centred sum of squares not computed before the arrival (its partial is then garbage)
    m = re.search(r"\n(\s+)(t\d+) = \(x\d+ - mu\d+\)\n(?:.*\n)*?\s+(r\d+) = gl.sum\((b\d+), axis=1, keep_dims=True\)\n", src)
    if m:
        out["no piece variance"] = src.replace(m.group(0), f"\n{m.group(1)}{m.group(3)} = mu{m.group(0).split('mu')[1].split(')')[0]} * 0.0\n", 1)
    # the combine's spread term dropped
    m = re.search(r"(r\d+) = gl.sum\(n\d+ \* \(mu\d+ - v\d+\) \* \(mu\d+ - v\d+\), axis=1, keep_dims=True\)", src)
    if m:
        out["no spread"] = src.replace(m.group(0), f"{m.group(1)} = v{int(m.group(1)[1:]) - 4} * 0.0", 1)
    # the combined variance replaced by a constant (the variance's partials still loaded)
    m = re.search(r"(r\d+) = gl.sum\((parts\d+), axis=1, keep_dims=True\) \+ [\d.e-]+ \* r\d+", src)
    if m:
        out["no variance combine"] = src.replace(m.group(0), f"{m.group(1)} = gl.sum({m.group(2)}, axis=1, "
                                                 f"keep_dims=True) * 0.0 + 1.0", 1)
    # the mean's partial stored together with the variance's, right before the arrival
    m = re.search(r"\n(\s+gl.store\(buf0 \+ pid_s \* \d+ \+ p, r\d+\))", src)
    m2 = re.search(r"\n(\s+gl.store\(buf1_mean_1 \+ pid_s \* \d+ \+ p, r\d+\))", src)
    if m and m2:
        moved = src.replace(m.group(0), "", 1)
        out["partials stored together"] = moved.replace(m2.group(0), m2.group(0) + m.group(0), 1)
    # the poll a plain (volatile) load in every thread, one fence after it, instead of one thread's acquiring load
    # (Triton's lowering of an acquiring add of 0) whose value reaches the others through shared memory and a barrier
    m = re.search(r"\n(\s+)arrived = gl.atomic_add\((\w+ \+ pid_p), 0, sem='acquire', scope='gpu'\)\n", src)
    if m:
        ind = m.group(1)
        polled = src.replace(m.group(0), f"\n{ind}arrived = gl.load({m.group(2)}, volatile=True)\n"
                             f"{ind[:-4]}_fence_acq_rel()\n", 1)
        out["load poll"] = polled.replace("\n@gluon.jit\ndef _part0", FENCE + "@gluon.jit\ndef _part0", 1)
    # loads that do not depend on the barrier (batch norm's weight and bias) issued at the top of the block, not after
    # the poll (an acquiring loop keeps them behind it)
    after = src[src.find("while arrived < launch_base"):]
    late = re.findall(r"\n\s+x\d+ = gl\.load\(in\d+_\w+ \+ c1\)", after)
    top = re.search(r"\n(\s+)c1 = p\n", src)
    if late and top:
        hoisted = src
        for line in late:
            hoisted = hoisted.replace(line, "", 1)
        out["parameters loaded first"] = hoisted.replace(top.group(0), top.group(0) + "".join(
            "\n" + top.group(1) + line.strip() for line in late)[1:] + "\n", 1)
    # the piece two blocks ahead prefetched into L2 (prefetch.global.L2, one line per 128 bytes) right after the next
    # piece's TMA copies, so that DRAM keeps reading while the SMs wait at their barriers
    m = re.search(r"\n(\s+)if pid_p \+ (\d+) < (\d+):\n\s+mbarrier\.expect", src)
    w = re.search(r"\n(\s+)while arrived < launch_base", src)
    if m and w:
        ahead, blocks, ind = 2 * int(m.group(2)), m.group(3), w.group(1)
        plane = re.search(r"mask_l = l % (\d+) < (\d+)", src)
        if plane:  # batch norm: image l // pad, point l % pad of channel pid_p + ahead
            pad = int(plane.group(1))
            store = re.search(r"gl\.store\(out0 \+ (c\d+) \+ (c\d+) \* (\d+) \+ c1 \* (\d+)", src)
            image, chan = store.group(3), store.group(4)
            target = (f"in0 + (l % {pad}) + (l // {pad}) * {image} + (pid_p + {ahead}) * {chan}",
                      f"((l % 32) == 0) & mask_l")
        else:  # column blocks: one line per row of the piece
            bp = int(re.search(r"\(pid_p\) \* (\d+) \+ gl\.arange", src).group(1))
            cols = int(re.search(r"gl\.store\(out0 \+ c\d+ \* (\d+) \+ c1", src).group(1))
            rows = int(re.search(r"gl\.arange\(0, (\d+), layout=gl\.SliceLayout\(0, LAYOUT\)\)\[None, :\]\n\s+mbarrier",
                                 src).group(1))
            # the piece's rows as a [BP, rows // BP] tile: a few rows per thread, where an [1, rows] tile of
            # pointers took 64 registers a thread and spilled
            first = (f"(lo + gl.arange(0, {bp}, layout=gl.SliceLayout(1, LAYOUT))[:, None] * {rows // bp} + "
                     f"gl.arange(0, {rows // bp}, layout=gl.SliceLayout(0, LAYOUT))[None, :])")
            target = (f"in0 + {first} * {cols} + (pid_p + {ahead}) * {bp}", "pid_p + 0 * " + first + " >= 0")
        code = (f"\n{ind}if pid_p + {ahead} < {blocks}:\n{ind}    _prefetch_l2({target[0]}, {target[1]})")
        pre = src.replace(w.group(0), code + w.group(0), 1)
        out["L2 prefetch two blocks ahead"] = pre.replace("\n@gluon.jit\ndef _part0", PREFETCH + "@gluon.jit\ndef _part0", 1)
    # the arrival's old count not used (a release `red`, whose return no warp waits for), so the next piece's copies go
    # out while the arrival travels; the first poll's count gives this launch's base instead
    m = re.search(r"\n(\s+)arrived = gl\.atomic_add\((\w+ \+ pid_p), 1, sem='acq_rel', scope='gpu'\)\n\s+launch_base = "
                  r"arrived // (\d+) \* \d+\n\s+arrived \+= 1\n", src)
    w = re.search(r"\n(\s+)while arrived < launch_base", src)
    if m and w:
        ind, counter, rounds = m.group(1), m.group(2), m.group(3)
        unwaited = src.replace(m.group(0), f"\n{ind}gl.atomic_add({counter}, 1, sem='release', scope='gpu')\n", 1)
        unwaited = unwaited.replace(w.group(0), f"\n{ind}arrived = gl.atomic_add({counter}, 0, sem='acquire', scope='gpu')"
                                    f"\n{ind}launch_base = (arrived - 1) // {rounds} * {rounds}" + w.group(0), 1)
        out["arrival not waited for"] = unwaited
    return out


CONFIGS = [  # --configs: the generated kernel alone, over other tilings of the column blocks
    Config(32, 1024, 64, 8, persistent=128, coop=True, tma=True),
    Config(16, 2048, 32, 8, persistent=128, coop=True, tma=True),  # 4 groups of 32: smaller, less aligned groups
    Config(8, 4096, 16, 8, persistent=128, coop=True, tma=True),  # 8 groups of 16
    Config(32, 512, 128, 8, persistent=128, coop=True, tma=True),  # one group over the GPU (a cooperative launch)
    # two programs per SM, so that one program's barrier falls in the other's streaming
    Config(32, 512, 128, 4, persistent=256, coop=True, tma=True),  # the autotuning space's
    Config(32, 512, 128, 8, persistent=256, coop=True, tma=True),
    Config(16, 1024, 64, 8, persistent=256, coop=True, tma=True),  # four groups of 64
    Config(16, 1024, 64, 4, persistent=256, coop=True, tma=True),
]


def time_configs(name: str, rounds: int = 3) -> None:
    """Every config of CONFIGS, cooperative launch or not, timed in `rounds` rounds in turn."""
    shape = SETUPS[name][0]
    k, strides = pattern_kernel(name, shape)
    args = PATTERNS[name].make(shape, torch.float32, "cuda", torch.Generator().manual_seed(0))
    env = dict(zip(k.inputs, args if isinstance(args, tuple) else (args,)))
    ref = PATTERNS[name].module()(*env.values())
    launches = {}
    for cfg in CONFIGS:
        spec = build_kernel(k.graph, [(k.plans[0], cfg)], strides, False, k.title, k.group_names)
        # a cooperative launch against a plain one, where the groups fit without it
        for cooperative in (True, False) if cfg.split <= 64 and cfg.persistent <= 128 else (True,):
            launch = Launch(k.graph, dataclasses.replace(spec, cooperative=cooperative), f"{name}:{cfg}")
            try:
                launch(env)
            except ValueError as refusal:  # not resident at once
                print(f"{name} {cfg}: {refusal}", flush=True)
                continue
            err = (env[spec.outputs[0]] - ref).abs().max().item()
            launches[f"{cfg} cooperative={cooperative} (max error {err:.1e})"] = launch
    times = {label: [] for label in launches}
    for _ in range(rounds):
        for label, launch in launches.items():
            times[label].append(timed_median(lambda: launch(env), budget_s=0.3) * 1e6)  # the clean flush, as the bench
    for label, ts in times.items():
        print(f"{name} {label}: " + " / ".join(f"{t:.1f}" for t in ts) + " us", flush=True)


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "column_standardize"
    if "--configs" in sys.argv:
        return time_configs(name)
    shape, cfg = SETUPS[name]
    k, strides = pattern_kernel(name, shape)
    spec = build_kernel(k.graph, [(k.plans[0], cfg)], strides, False, k.title, k.group_names)
    args = PATTERNS[name].make(shape, torch.float32, "cuda", torch.Generator().manual_seed(0))
    env = dict(zip(k.inputs, args if isinstance(args, tuple) else (args,)))
    ref = PATTERNS[name].module()(*env.values())
    for label, src in variants(spec.source).items():
        launch = Launch(k.graph, dataclasses.replace(spec, source=src), f"{name}:{label}")
        launch(env)
        err = (env[spec.outputs[0]] - ref).abs().max().item()
        t = do_bench(lambda: launch(env), warmup=5, rep=100, return_mode="median")
        print(f"{name} {cfg} {label}: {t * 1e3:.1f} us (max error {err:.1e})", flush=True)


if __name__ == "__main__":
    main()
