"""Cooperative row splits (mapping.Config.coop): the programs of a long row keep their pieces in
registers and meet at an in-kernel barrier. The interpreter runs programs one at a time, so on
CPU the generated kernels are compiled for sm_90 (a fresh process without the interpreter) and
the refusals checked; on a GPU they are run against eager."""

import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("STITCHFLOW_CACHE", tempfile.mkdtemp(prefix="stitchflow-test-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402

import stitchflow  # noqa: E402
from stitchflow.bench.stitching_patterns import (PATTERNS, as_tuple, pattern_kernel, relative_error,  # noqa: E402
                                                 tolerance)
from stitchflow.targets.gpu.mapping import (Config, candidates, coop_refusal, max_coop_split, n_chunks,  # noqa: E402
                                            resident_per_sm)  # noqa: E402

COMPILE = """
import json, re, subprocess, sys, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from stitchflow.bench.stitching_patterns import pattern_kernel
from stitchflow.targets.gpu.codegen import build_kernel
from stitchflow.targets.gpu.mapping import Config
from stitchflow.targets.gpu.runtime import load_source

TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.int64: "*i64"}
out = []
for name, shape, dtype, cfg in json.loads(sys.stdin.read()):
    k, strides = pattern_kernel(name, shape, getattr(torch, dtype))
    spec = build_kernel(k.graph, [(k.plans[0], Config(**cfg))], strides, False, k.title, k.group_names)
    fn = load_source(spec.source).kernel
    dts = [k.graph.type_of[t].dtype for t in spec.inputs + spec.outputs] + [b[2] for b in spec.buffers]
    sig = {n: TYPES[d] for n, d in zip(fn.arg_names, dts)}
    sig["PHASE"] = "constexpr"
    kernel = triton.compile(ASTSource(fn, sig, constexprs={"PHASE": 0}), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": spec.num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([f"{triton.__path__[0]}/backends/nvidia/bin/cuobjdump", "--dump-resource-usage",
                                f.name], capture_output=True, text=True).stdout
    field = {key: int(v) for key, v in re.findall(r"(REG|STACK|LOCAL):(\\d+)", usage)}
    out.append({"phases": spec.phases, "counters": [b[1] for b in spec.buffers if b[2] == torch.int64],
                "spilled": field["STACK"] + field["LOCAL"], "barriers": spec.source.count("sem='acq_rel'"),
                "bases": spec.source.count("launch_base = "),
                "acquire_loads": kernel.asm["ptx"].count("ld.global.gpu.acquire")})
print(json.dumps(out))
"""

CASES = [  # pattern, shape, dtype, config, (barriers: one per stage feeding a later one, but a centred
    # variance meets at its mean's where the piece is one chunk and, for rows, at most 16 elements a thread; row blocks)
    ("softmax_long_rows", (4, 65536), "float32", Config(1, 16384, 4, 16, coop=True), (1, 4)),
    ("softmax_long_rows", (3, 40000), "float32", Config(1, 8192, 5, 8, coop=True), (1, 3)),
    ("add_layernorm_gelu", (2, 50000), "bfloat16", Config(1, 8192, 7, 16, coop=True), (1, 2)),
    ("column_standardize", (8200, 96), "float32", Config(32, 512, 17, 8, coop=True), (1, 3)),  # tiles 32 columns wide
    ("batchnorm_train", (4, 24, 30, 30), "float32", Config(1, 512, 8, 4, coop=True), (1, 24)),  # rows are (N, H, W)
    # the bench's shape: 64 elements per thread, which spilled while H and W had index math of their own
    ("batchnorm_train", (64, 256, 56, 56), "float32", Config(1, 16384, 13, 8, coop=True), (2, 256)),
    # pieces of several chunks, read again from L2 after each barrier (a variance then has its own)
    ("column_standardize", (8200, 96), "float32", Config(32, 128, 17, 8, coop=True), (2, 3)),
    ("batchnorm_train", (4, 24, 30, 30), "float32", Config(1, 512, 4, 4, coop=True), (2, 24)),
    ("softmax_long_rows", (3, 40000), "float32", Config(1, 4096, 3, 8, coop=True), (1, 3)),
    # persistent groups that prefetch their next row's piece
    ("softmax_long_rows", (37, 65536), "float32", Config(1, 8192, 8, 8, persistent=40, coop=True), (1, 37)),
    ("column_standardize", (8200, 200), "float32", Config(16, 512, 17, 8, persistent=34, coop=True), (1, 13)),
    ("add_layernorm_gelu", (9, 20000), "bfloat16", Config(1, 4096, 5, 8, persistent=15, coop=True), (1, 9)),
    # group norm's 65536-element groups seen through the grouped view: one barrier, contiguous loads
    ("groupnorm_silu", (2, 512, 32, 32), "bfloat16", Config(1, 2048, 8, 16, coop=True), (1, 64)),
    ("groupnorm_silu", (2, 512, 32, 32), "bfloat16", Config(1, 8192, 2, 8, coop=True), (2, 64)),
]


def test_coop_kernels_compile_for_sm90_in_one_launch(fresh_python):
    payload = [(name, shape, dtype, dict(vars(cfg))) for name, shape, dtype, cfg, _ in CASES]
    for (name, shape, _, _, (barriers, blocks)), got in zip(CASES, fresh_python(COMPILE, payload)):
        assert got["phases"] == 1 and got["spilled"] == 0, (name, shape, got)
        assert got["counters"] == [blocks]             # one arrival counter per block of rows, never reset
        assert got["barriers"] == barriers              # an arrival per barrier
        assert got["bases"] == 1                        # the first arrival tells which launch this is
        assert got["acquire_loads"] == barriers         # the poll is an acquiring load, not an atomic


def _plan(name, shape):
    return pattern_kernel(name, shape)[0].plans[0]


def test_long_rows_get_coop_candidates_and_the_rest_say_why_not():
    long_rows = _plan("softmax_long_rows", (4, 65536))
    coop = [c for c in candidates(long_rows) if c.coop]
    assert coop and all(coop_refusal(long_rows, c) is None for c in coop)
    assert not [c for c in candidates(_plan("softmax_long_rows", (4, 1000))) if c.coop]
    assert "split > 1" in coop_refusal(long_rows, Config(1, 65536, 1, 16, coop=True))
    columns = _plan("column_standardize", (65536, 1024))
    assert [c for c in candidates(columns) if c.coop and c.BP == 32]
    for c in candidates(columns) + candidates(long_rows):  # pieces held in registers, groups that always fit
        assert not c.coop or c.tma or (c.split <= max_coop_split(132) and n_chunks(columns if c.BP > 1 else long_rows, c) == 1)
    assert coop_refusal(columns, Config(32, 128, 64, 8, coop=True)) is None  # re-read from L2: an option
    assert "must be one chunk" in coop_refusal(long_rows, Config(1, 4096, 4, 16, persistent=8, coop=True))
    # a pinned split of a row that fits one chunk is clamped to 1: nobody to meet, so no barrier
    (pinned,) = candidates(_plan("softmax_long_rows", (4, 1000)), override={"block_l": 1024, "split": 4, "coop": True})
    assert pinned.split == 1 and not pinned.coop


def test_no_config_asks_for_a_tile_over_tritons_largest_tensor():
    """A packed launch's unsplit fallback pins 32768-long chunks; over wide column blocks that was a
    [64, 32768] tile, which Triton refuses to compile (ResNet-18's stem backward ran eagerly)."""
    columns = _plan("column_standardize", (65536, 1024))
    (pinned,) = candidates(columns, override={"split": 1, "block_l": 1 << 15, "block_p": 64})
    assert pinned.BP == 64 and pinned.BP * pinned.BL <= 1 << 20
    assert all(c.BP * c.BL <= 1 << 20 for c in candidates(columns))


def test_centred_variances_are_found_where_they_are():
    from stitchflow.targets.gpu.codegen_split import centred_variances

    found = {}
    for name, shape in (("column_standardize", (64, 16)), ("batchnorm_train", (2, 3, 4, 4)),
                        ("add_layernorm_gelu", (4, 32)), ("softmax_long_rows", (3, 700)), ("rmsnorm_residual", (7, 33))):
        args = PATTERNS[name].make(shape, torch.float32, "cpu", torch.Generator().manual_seed(0))
        prog = stitchflow.compile(PATTERNS[name].module(), args, target="gpu", fusion="full")
        (k,) = [k for run in prog._compiled for k in run.kernels]
        found[name] = centred_variances(k.graph, k.plans[0])
    assert found["column_standardize"] == {"mean_1": ("mean", 1 / 64)}
    assert found["batchnorm_train"] == {"mean_1": ("mean", 1 / 32)}
    assert found["add_layernorm_gelu"] == {"layer_norm_var": ("layer_norm_mean", 1 / 32)}
    assert found["softmax_long_rows"] == {} and found["rmsnorm_residual"] == {}  # no centring: nothing to meet


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="checks the interpreter's refusal; with a GPU (TRITON_INTERPRET=0) the split runs")
def test_coop_is_refused_under_the_interpreter():
    args = PATTERNS["softmax_long_rows"].make((3, 700), torch.float32, "cpu", torch.Generator().manual_seed(0))
    prog = stitchflow.compile(PATTERNS["softmax_long_rows"].module(), args, target="gpu", fusion="full",
                              options={"block_l": 512, "split": 2, "coop": True})
    with pytest.raises(ValueError, match="needs a GPU"):
        prog(*args)


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a CUDA GPU (the programs of a row run at once)")
@pytest.mark.parametrize("name,shape,dtype,cfg,_", CASES)
def test_coop_split_equals_eager_on_gpu(name, shape, dtype, cfg, _):
    dtype = getattr(torch, dtype)
    module = PATTERNS[name].module()
    options = {"block_p": cfg.BP, "block_l": cfg.BL, "split": cfg.split, "num_warps": cfg.num_warps, "coop": True,
               "persistent": cfg.persistent}
    for seed in (0, 1):  # twice, and two calls each: every launch must find its own round of the counters
        args = PATTERNS[name].make(shape, dtype, "cuda", torch.Generator().manual_seed(seed))
        prog = stitchflow.compile(module, args, target="gpu", fusion="full", options=options)
        for _ in range(2):
            for o, r in zip(as_tuple(prog(*args)), as_tuple(module(*args))):
                assert relative_error(o, r) <= tolerance(dtype)
        counters = [c for run in prog._compiled for k in run.kernels for launch in k._built.values()
                    for buffers in launch.counters.values() for c in buffers if c.dtype == torch.int64]
        assert counters and all(int(c.min()) == int(c.max()) > 0 for c in counters)  # every row: all arrivals


def test_resident_programs_per_sm_follow_hoppers_limits():
    assert resident_per_sm(8, 32, 0) == 8          # 64 warps
    assert resident_per_sm(4, 255, 0) == 2         # registers: 8192 per warp, 64K per SM
    assert resident_per_sm(1, 16, 100_000) == 2    # shared memory
    assert resident_per_sm(1, 16, 0) == 32         # the per-SM program limit


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a CUDA GPU (the programs of a row run at once)")
def test_coop_split_replays_as_a_cuda_graph():
    """The graph captures the counters' address once: every replay must find them at zero again."""
    module = PATTERNS["column_standardize"].module()
    args = PATTERNS["column_standardize"].make((8200, 96), torch.float32, "cuda", torch.Generator().manual_seed(0))
    prog = stitchflow.compile(module, args, target="gpu", fusion="full",
                              options={"block_p": 32, "block_l": 512, "split": 17, "num_warps": 8, "coop": True,
                                       "cuda_graphs": "always"})
    for seed in range(5):
        fresh = PATTERNS["column_standardize"].make((8200, 96), torch.float32, "cuda",
                                                    torch.Generator().manual_seed(seed))
        for o, r in zip(as_tuple(prog(*fresh)), as_tuple(module(*fresh))):
            assert relative_error(o, r) <= tolerance(torch.float32)
    assert prog._replay.graph is not None, prog._replay.failed
