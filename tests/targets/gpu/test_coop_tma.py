"""TMA-fed cooperative column pieces (codegen_tma, gluon_dialect): the generated Triton source is
translated to Gluon, whose persistent programs stream their next piece into shared memory while
the current one waits at its barrier. On CPU: the translation, the refusals, and sm_90 compiles
(a fresh process without the interpreter); on a Hopper GPU: equality with eager."""

import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("STITCHFLOW_CACHE", tempfile.mkdtemp(prefix="stitchflow-test-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402

import stitchflow  # noqa: E402
from stitchflow.bench.stitching_patterns import (PATTERNS, as_tuple, pattern_kernel, relative_error,  # noqa: E402
                                                 tolerance)
from stitchflow.targets.gpu.codegen import build_kernel  # noqa: E402
from stitchflow.targets.gpu.gluon_dialect import GluonRefusal, blocked_layout, to_gluon  # noqa: E402
from stitchflow.targets.gpu.mapping import Config, candidates, coop_refusal  # noqa: E402

COMPILE = """
import json, sys
import torch
from stitchflow.bench.stitching_patterns import pattern_kernel
from stitchflow.targets.gpu.chain_wgmma import compile_gluon_sm90
from stitchflow.targets.gpu.codegen import build_kernel
from stitchflow.targets.gpu.mapping import Config
from stitchflow.targets.gpu.runtime import load_source, tma_descriptor

out = []
for name, shape, dtype, cfg in json.loads(sys.stdin.read()):
    k, strides = pattern_kernel(name, shape, getattr(torch, dtype))
    spec = build_kernel(k.graph, [(k.plans[0], Config(**cfg))], strides, False, k.title, k.group_names)
    typed = lambda t: torch.empty(k.graph.type_of[t].shape, dtype=k.graph.type_of[t].dtype)
    kernel_args = [typed(t) for t in spec.inputs + spec.outputs] + [torch.empty(n, dtype=dt) for _, n, dt in
                                                                     spec.buffers]
    kernel_args += [tma_descriptor(typed(t), box, view) for t, box, view in spec.tma]
    report = compile_gluon_sm90(load_source(spec.source).kernel, tuple(kernel_args), {"PHASE": 0}, spec.num_warps,
                                ints=())
    report.update(grid=spec.grid, tma=[list(box) for _, box, _ in spec.tma], copies=spec.source.count("tma.async_copy"),
                  arrivals=spec.source.count("sem='acq_rel'"))
    out.append(report)
print(json.dumps(out))
"""

BENCH = (65536, 1024)
CASES = [  # pattern, shape, dtype, config (a persistent grid of whole groups), TMA copies in the source
    ("column_center", BENCH, "float32", Config(32, 1024, 64, 8, persistent=128, coop=True, tma=True), 8),
    ("column_standardize", BENCH, "float32", Config(32, 1024, 64, 8, persistent=128, coop=True, tma=True), 8),
    ("column_standardize", BENCH, "float32", Config(32, 512, 128, 4, persistent=256, coop=True, tma=True), 4),
    ("column_center", (8192, 96), "bfloat16", Config(32, 512, 16, 4, persistent=128, coop=True, tma=True), 4),
    ("column_standardize", (4096, 160), "float32", Config(32, 128, 32, 4, persistent=64, coop=True, tma=True), 2),
    # pieces shorter than the tile (masked), so that whole groups fill the SMs: 4096 rows over 33 programs
    ("column_standardize", (4096, 160), "float32", Config(32, 128, 33, 4, persistent=66, coop=True, tma=True), 2),
    ("column_center", BENCH, "float32", Config(32, 1024, 66, 8, persistent=132, coop=True, tma=True), 8),
    # 256-byte box rows, which Triton copies as two messages: a piece is one box
    ("column_center", (4096, 128), "float32", Config(64, 256, 16, 4, persistent=32, coop=True, tma=True), 2),
]
PLANES = [  # batch norm's channels: pieces of whole planes, one TMA box each ([64, 64] over 49x64; [64, 16] over 49x16)
    ("batchnorm_train", (64, 256, 56, 56), "float32", Config(1, 32768, 8, 8, persistent=128, coop=True, tma=True), 16),
    ("batchnorm_train", (64, 256, 56, 56), "float32", Config(1, 16384, 16, 4, persistent=256, coop=True, tma=True), 8),
    ("batchnorm_train", (16, 40, 28, 28), "bfloat16", Config(1, 4096, 4, 4, persistent=64, coop=True, tma=True), 8),
    ("batchnorm_train", (16, 40, 28, 28), "float32", Config(1, 4096, 4, 4, persistent=64, coop=True, tma=True), 8),
]
CP_ASYNC = [  # rows and batch norm's channels: cp.async pieces at the loads' own addresses (masked past the row)
    ("batchnorm_train", (4, 24, 30, 30), "float32", Config(1, 512, 8, 4, persistent=64, coop=True, cp_async=True)),
    ("softmax_long_rows", (5, 40000), "float32", Config(1, 4096, 10, 4, persistent=40, coop=True, cp_async=True)),
    ("batchnorm_train", (64, 256, 56, 56), "float32",
     Config(1, 4096, 49, 4, persistent=245, coop=True, cp_async=True)),
]


def test_tma_kernels_compile_for_sm90_without_spills(fresh_python):
    payload = [(name, shape, dtype, dict(vars(cfg))) for name, shape, dtype, cfg, _ in CASES]
    for (_, shape, dtype, cfg, copies), got in zip(CASES, fresh_python(COMPILE, payload)):
        # masked pieces: a few bytes; 128 splits' partials at 4 warps (the variance's combine): 8 bytes
        assert got["spilled"] <= (160 if cfg.split * cfg.BL > shape[0] else 16 if cfg.split > 64 else 0)
        assert got["tma"] == [[min(256, cfg.BL), cfg.BP]]
        assert got["copies"] == copies               # the first piece, and the next one after the arrival
        assert got["arrivals"] == 1                  # the variance meets at its mean's barrier
        assert got["grid"] == cfg.split * min(shape[1] // cfg.BP, cfg.persistent // cfg.split)
        assert got["smem"] >= cfg.BL * cfg.BP * (2 if dtype == "bfloat16" else 4)  # the piece's buffer


def test_plane_pieces_compile_for_sm90_without_spills(fresh_python):
    payload = [(name, shape, dtype, dict(vars(cfg))) for name, shape, dtype, cfg, _ in PLANES]
    for (_, shape, dtype, cfg, copies), got in zip(PLANES, fresh_python(COMPILE, payload)):
        assert got["spilled"] == 0
        assert got["tma"] == [[1, 64, 64 if shape[-1] == 56 else 16]]  # one box per plane, rows past it zero-filled
        assert got["copies"] == copies               # a box per plane: the first piece, and the next one
        assert got["arrivals"] == 1                  # the variance meets at its mean's barrier (Chan)
        assert got["grid"] == cfg.persistent
        assert got["smem"] >= cfg.BL * (2 if dtype == "bfloat16" else 4)


def test_plane_pieces_number_points_plane_by_plane():
    k, strides = pattern_kernel("batchnorm_train", (64, 256, 56, 56))
    spec = build_kernel(k.graph, [(k.plans[0], PLANES[0][3])], strides, False, k.title, k.group_names)
    src = spec.source
    assert spec.tma == (("x", (1, 64, 64), (64 * 256, 49, 64)),)
    assert "mask_l = l % 4096 < 3136" in src and "smem0.reshape([1, 32768]).load(LAYOUT)" in src
    assert "[(lo // 4096 + 7) * 256 + (pid_p + 16), 0, 0]" in src  # the 8th plane of the next channel
    assert src.index("sem='acq_rel'") < src.index("if pid_p + 16 < 256:") < src.index("while arrived < launch_base")
    # the weight and bias vary with the channel alone: loaded before the barrier, not behind its poll
    assert src.count("gl.load(in1 + ") == src.count("gl.load(in2 + ") == 1
    assert src.index("gl.load(in2 + ") < src.index("sem='acq_rel'")
    tma = [c for c in candidates(k.plans[0], 132) if c.tma]
    assert {(c.BL, c.split, c.num_warps, c.persistent) for c in tma} == {(32768, 8, 8, 128), (16384, 16, 4, 256)}
    odd, strides = pattern_kernel("batchnorm_train", (6, 8, 5, 5))  # planes of 25: no 16-byte box rows
    assert not [c for c in candidates(odd.plans[0], 132) if c.tma]
    with pytest.raises(GluonRefusal, match="no TMA box"):
        build_kernel(odd.graph, [(odd.plans[0], Config(1, 64, 3, 4, persistent=66, coop=True, tma=True))], strides,
                     False, odd.title, odd.group_names)


def test_cp_async_kernels_compile_for_sm90(fresh_python):
    payload = [(name, shape, dtype, dict(vars(cfg))) for name, shape, dtype, cfg in CP_ASYNC]
    for (_, _, _, cfg), got in zip(CP_ASYNC, fresh_python(COMPILE, payload)):
        assert got["spilled"] == 0 and got["tma"] == [] and got["copies"] == 0
        assert got["smem"] >= cfg.BL * 4  # the piece's buffer


def test_the_generated_source_becomes_gluon_with_one_layout():
    k, strides = pattern_kernel("column_center", BENCH)
    spec = build_kernel(k.graph, [(k.plans[0], CASES[0][3])], strides, False, k.title, k.group_names)
    src = spec.source
    assert "@triton.jit" not in src and "tl." not in src.replace("tl.PropagateNan", "") and "@gluon.jit" in src
    assert "gl.arange(0, 32, layout=gl.SliceLayout(1, LAYOUT))[:, None]" in src
    assert "smem0.permute((1, 0)).load(LAYOUT)" in src
    assert src.index("sem='acq_rel'") < src.index("if pid_p + 2 < 32:") < src.index("while arrived < launch_base + 64")
    assert spec.tma == (("x", (256, 32), None),) and spec.grid == 128


def test_translation_lays_out_fills_and_refuses_what_gluon_lacks():
    from stitchflow.targets.gpu.codegen_header import APPROX_PTX, HEADER

    module = HEADER.format(title="t", approx=APPROX_PTX)
    body = ("@triton.jit\ndef f(x):\n    a = tl.full([32, 1], 0.0, tl.float32)\n"
            "    b = tl.broadcast_to(a, [32, 64])\n    tl.debug_barrier()\n")
    out = to_gluon(module + body, blocked_layout(32, 8, 4))
    assert "gl.full([32, 1], 0.0, gl.float32, layout=LAYOUT)" in out and "_broadcast_to(a, [32, 64])" in out
    assert "gl.thread_barrier()" in out
    # a NaN-keeping max: Gluon's functions take Triton's enum as it is
    nan_max = "@triton.jit\ndef g(a, b):\n    return tl.reduce(tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL), 1, _max_nan)\n"
    out = to_gluon(module + nan_max, blocked_layout(32, 8, 4))
    assert "gl.reduce(gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL), 1, _max_nan)" in out
    assert "import triton.language as tl" in out and "@gluon.jit\ndef _max_nan(a, b):" in out
    assert "threads_per_warp=[8, 4]" in blocked_layout(32, 8, 4) and "[8, 1]" in blocked_layout(32, 4, 2)
    with pytest.raises(GluonRefusal, match="tl.sigmoid"):
        to_gluon(module + "@triton.jit\ndef g(x):\n    return tl.sigmoid(x)\n", "L")
    with pytest.raises(GluonRefusal, match="libdevice"):
        to_gluon(module + "@triton.jit\ndef g(x):\n    return libdevice.pow(x, 2.0)\n", "L")


@pytest.mark.parametrize("name,shape,cfg,strides,why", [
    ("batchnorm_train", (4, 24, 30, 30), Config(1, 512, 8, 4, persistent=128, coop=True, tma=True), None,
     "whole number of 1024-slot planes"),
    ("batchnorm_train", (4, 24, 30, 30), Config(1, 2048, 2, 4, persistent=128, coop=True, tma=True),
     {"x": (21600, 1, 720, 24), "w": (1,), "b": (1,)}, "plane by plane"),
    ("batchnorm_train", (4, 24, 30, 30), Config(1, 2048, 2, 4, persistent=128, coop=True, tma=True),
     {"x": (2 ** 30, 900, 30, 1), "w": (1,), "b": (1,)}, "64-bit offsets"),
    ("column_center", (1000, 96), Config(32, 128, 4, 4, persistent=64, coop=True, tma=True), None, "one chunk"),
    ("column_center", (1000, 90), Config(32, 128, 8, 4, persistent=64, coop=True, tma=True), None, "whole column"),
    ("column_center", (4096, 96), Config(32, 4096, 1, 4, persistent=64, coop=True, tma=True), None, "shared memory"),
    ("column_center", (4096, 64), Config(32, 512, 8, 4, persistent=64, coop=True, tma=True), {"x": (1, 4096)},
     "not a row-major"),
    ("column_center", (4096, 64), Config(32, 512, 8, 4, coop=True, tma=True), None, "persistent"),
    ("column_center", (4096, 128), Config(64, 512, 8, 4, persistent=64, coop=True, tma=True), None,
     "span over 128 bytes"),
])
def test_parts_the_tma_path_cannot_take_are_refused_with_the_reason(name, shape, cfg, strides, why):
    k, strides = pattern_kernel(name, shape, strides=strides)
    with pytest.raises(GluonRefusal, match=why):
        build_kernel(k.graph, [(k.plans[0], cfg)], strides, False, k.title, k.group_names)
    with pytest.raises(GluonRefusal, match="interpreter"):  # under the interpreter: never
        build_kernel(k.graph, [(k.plans[0], CASES[0][3])], strides, True, k.title, k.group_names)


def test_cp_async_pieces_need_four_byte_elements_and_stream_after_the_last_arrival():
    k, strides = pattern_kernel("softmax_long_rows", (5, 40000), torch.bfloat16)
    with pytest.raises(GluonRefusal, match="4-byte elements"):
        build_kernel(k.graph, [(k.plans[0], CP_ASYNC[1][3])], strides, False, k.title, k.group_names)
    k, strides = pattern_kernel("batchnorm_train", (4, 24, 30, 30))
    src = build_kernel(k.graph, [(k.plans[0], CP_ASYNC[0][3])], strides, False, k.title, k.group_names).source
    assert src.count("async_copy.async_copy_global_to_shared(") == 2 and src.count("commit_group()") == 2
    last_arrival = src.rindex("sem='acq_rel'")
    assert src.index("async_copy.wait_group(0)") < src.index("sem='acq_rel'")
    assert last_arrival < src.index("if pid_p + 8 < 24:") < src.rindex("while arrived < launch_base")
    assert "layout=gl.SliceLayout(0, LAYOUT))[None, :]" in src and "order=[1, 0]" in src


def test_persistent_cooperative_grids_and_only_they_launch_cooperatively():
    k, strides = pattern_kernel("column_center", BENCH)

    def spec(cfg):
        return build_kernel(k.graph, [(k.plans[0], cfg)], strides, False, k.title, k.group_names)
    assert spec(CASES[0][3]).cooperative                     # the driver runs every program at once, or refuses
    assert not spec(Config(32, 1024, 64, 8, coop=True)).cooperative  # one launch of many groups, in turn
    assert not spec(Config(32, 1024)).cooperative


def test_column_blocks_get_tma_candidates_of_whole_resident_groups():
    k, _ = pattern_kernel("column_standardize", BENCH)
    tma = [c for c in candidates(k.plans[0], 132) if c.tma]
    assert {(c.BP, c.BL, c.num_warps, c.split, c.persistent) for c in tma} == {(32, 1024, 8, 64, 128),
                                                                               (32, 512, 4, 128, 256)}
    for c in tma:
        assert coop_refusal(k.plans[0], c) is None and c.persistent % c.split == 0
        assert c.persistent <= 132 * (2 if c.num_warps == 4 else 1)
    rows, _ = pattern_kernel("softmax_long_rows", (4, 65536))
    assert not [c for c in candidates(rows.plans[0], 132) if c.tma]
    assert "persistent grid" in coop_refusal(k.plans[0], Config(32, 1024, 64, 8, coop=True, tma=True))


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
                    or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper GPU (TMA, Gluon)")
@pytest.mark.parametrize("name,shape,dtype,cfg", [c[:4] for c in CASES + PLANES] + CP_ASYNC)
def test_streamed_split_equals_eager_on_hopper(name, shape, dtype, cfg):
    dtype = getattr(torch, dtype)
    module = PATTERNS[name].module()
    options = {"block_p": cfg.BP, "block_l": cfg.BL, "split": cfg.split, "num_warps": cfg.num_warps, "coop": True,
               "persistent": cfg.persistent, "tma": cfg.tma, "cp_async": cfg.cp_async}
    for seed in (0, 1):
        args = PATTERNS[name].make(shape, dtype, "cuda", torch.Generator().manual_seed(seed))
        prog = stitchflow.compile(module, args, target="gpu", fusion="full", options=options)
        for _ in range(2):  # each launch waits for its own round of the counters
            for o, r in zip(as_tuple(prog(*args)), as_tuple(module(*args))):
                assert relative_error(o, r) <= tolerance(dtype)
        counters = [c for run in prog._compiled for k in run.kernels for launch in k._built.values()
                    for buffers in launch.counters.values() for c in buffers if c.dtype == torch.int64]
        assert counters and all(int(c.min()) == int(c.max()) > 0 for c in counters)  # every block: all arrivals
        assert [(c.tma, c.cp_async) for c in prog._compiled[0].kernels[0].chosen] == [(cfg.tma, cfg.cp_async)]


def test_pinned_tma_splits_may_cut_pieces_under_the_tile():
    k, _ = pattern_kernel("column_center", BENCH)
    (cfg,) = candidates(k.plans[0], 132, {"block_p": 32, "block_l": 1024, "split": 66, "num_warps": 8, "coop": True,
                                          "persistent": 132, "tma": True})
    assert (cfg.split, cfg.persistent, cfg.tma) == (66, 132, True)


def test_streamed_pieces_are_kept_from_where_they_cannot_run(monkeypatch):
    k, _ = pattern_kernel("column_center", BENCH)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the space a GPU run sees (nothing is launched here)
    assert any(c.tma for c in k._space(k.plans[0], 132, None))
    assert not any(c.tma or c.cp_async for c in k._space(k.plans[0], 132, "need a Hopper GPU (sm_90 or later)"))
    k.options = {**k.options, "coop": True, "tma": True, "persistent": 128, "split": 64, "block_p": 32,
                 "block_l": 1024}
    with pytest.raises(ValueError, match="16-byte aligned"):
        k._space(k.plans[0], 132, "need inputs whose base is 16-byte aligned (TMA)")
    whole = torch.empty(4096 * 64 + 1)
    aligned, shifted = whole[:-1].view(4096, 64), whole[1:].view(4096, 64)  # same strides, base 4 bytes apart
    assert k._signature({t: aligned for t in k.inputs}) != k._signature({t: shifted for t in k.inputs})
    assert [s[3] for s in k._signature({t: shifted for t in k.inputs})] == [False]


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
                    or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper GPU (TMA, Gluon)")
def test_a_misaligned_input_runs_without_streamed_pieces_on_hopper():
    module = PATTERNS["column_center"].module()
    whole = torch.randn(16384 * 256 + 1, device="cuda")
    for x in (whole[1:].view(16384, 256), whole[:-1].view(16384, 256)):  # base 4 bytes off 16, then aligned
        prog = stitchflow.compile(module, [x], target="gpu", fusion="full", options={"cuda_graphs": False})
        (out,) = as_tuple(prog(x))
        assert relative_error(out, module(x)) <= tolerance(torch.float32)
        (k,) = [k for run in prog._compiled for k in run.kernels]
        if x.data_ptr() % 16:
            assert not any(c.tma for c in k.chosen)


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
                    or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper GPU (TMA, Gluon)")
@pytest.mark.parametrize("name,shape,cfg", [(c[0], c[1], c[3]) for c in (CASES[1], PLANES[0])])
def test_centred_variances_hold_far_from_zero_on_hopper(name, shape, cfg):
    """Data whose mean is 10^3 of its spread: each piece centres on its own mean, and the spread of the pieces'
    means is taken about the first piece's (codegen_split._combine_variance), so nothing cancels: the result is
    as close to float64's as eager's float32 is (whose error here is mostly the float32 mean's)."""
    module = PATTERNS[name].module()
    args = list(PATTERNS[name].make(shape, torch.float32, "cuda", torch.Generator().manual_seed(3)))
    args[0] = args[0] * 0.1 + 100.0
    options = {"block_p": cfg.BP, "block_l": cfg.BL, "split": cfg.split, "num_warps": cfg.num_warps, "coop": True,
               "persistent": cfg.persistent, "tma": True}
    prog = stitchflow.compile(module, args, target="gpu", fusion="full", options=options)
    expected = module(*[a.double() for a in args]).float()
    eager = relative_error(module(*args), expected)
    assert relative_error(as_tuple(prog(*args))[0], expected) <= max(2 * eager, tolerance(torch.float32))
