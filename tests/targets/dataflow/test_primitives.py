"""Token-level behaviour of the primitives (spec/dataflow.md), including where we differ."""

import numpy as np
import pytest
import torch

from stitchflow.targets.dataflow import storage as S
from stitchflow.targets.dataflow.execute import join, read, repeat, scan
from stitchflow.targets.dataflow.graph import Prim
from stitchflow.targets.dataflow.execute import FUNCS
from stitchflow.targets.dataflow.stream import parse, root, tokens_str

# B with rows {0: [0, 2], 1: [], 2: [1]}, compressed rows and columns (the spec's example)
B = np.array([[1.0, 0, 2], [0, 0, 0], [0, 3, 0]])


def dcsr_b():
    return S.from_coo(np.array([[0, 0], [0, 2], [2, 1]]), np.array([1.0, 2.0, 3.0]), (3, 3), ("c", "c"))


def test_spec_example_streams():
    st = S.from_coo(np.array([[0, 0], [0, 2], [1, 0], [2, 1]])[[0, 1, 3]], np.array([1.0, 2, 3]), (3, 3), ("c", "c"))
    # rows {0, 2} only are stored; the spec's example lists row 1 with an empty fiber:
    st = S.Storage((S.LevelData("c", 3, np.array([0, 3]), np.array([0, 1, 2])),
                    S.LevelData("c", 3, np.array([0, 2, 2, 3]), np.array([0, 2, 1]))), np.array([1.0, 2, 3]))
    ci, ri = scan(root(), st.levels[0])
    assert tokens_str(ci) == "0 1 2 S0 D"
    cj, rj = scan(ri, st.levels[1])
    assert tokens_str(cj) == "0 2 S0 S0 1 S1 D"
    assert tokens_str(read(st, rj)) == "1 2 S0 S0 3 S1 D"


def test_scanner_stop_rules():
    level = S.LevelData("c", 5, np.array([0, 2, 2, 3]), np.array([1, 4, 0]))
    crd, ref = scan(parse("0 1 S0 2 S1 D"), level)
    assert tokens_str(crd) == "1 4 S0 S1 0 S2 D"
    # an empty input fiber (a bare stop) becomes S(n+1); N scans to N and a stop
    crd, _ = scan(parse("S0 D"), level)
    assert tokens_str(crd) == "S1 D"
    crd, ref = scan(parse("N 2 S0 D"), level)
    assert tokens_str(crd) == "N S0 0 S1 D"
    assert tokens_str(ref) == "N S0 2 S1 D"


def test_dense_scanner_refs():
    crd, ref = scan(parse("0 1 S0 D"), S.LevelData("d", 3))
    assert tokens_str(crd) == "0 1 2 S0 0 1 2 S1 D"
    assert tokens_str(ref) == "0 1 2 S0 3 4 5 S1 D"


def test_repeat_follows_signal_structure():
    x = parse("7 8 S0 D")
    sig = parse("0 1 S0 5 S1 D")
    assert tokens_str(repeat(x, sig)) == "7 7 S0 8 S1 D"
    # an empty parent fiber keeps its bare stop
    assert tokens_str(repeat(parse("7 S0 S1 D"), parse("1 2 S0 S2 D"))) == "7 7 S0 S2 D"


def test_intersect_and_union():
    a = (parse("0 2 3 S0 1 S1 D"), parse("10 12 13 S0 11 S1 D"))
    b = (parse("2 3 4 S0 S1 D"), parse("22 23 24 S0 S1 D"))
    c, ra, rb = join([a, b], ("and", (0, 1)))
    assert tokens_str(c) == "2 3 S0 S1 D"
    assert tokens_str(ra) == "12 13 S0 S1 D"
    assert tokens_str(rb) == "22 23 S0 S1 D"
    c, ra, rb = join([a, b], ("or", (0, 1)))
    assert tokens_str(c) == "0 2 3 4 S0 1 S1 D"
    assert tokens_str(ra) == "10 12 13 N S0 11 S1 D"
    assert tokens_str(rb) == "N 22 23 24 S0 N S1 D"


def test_join_skips_empty_coordinates():
    a = (parse("N S0 D"), parse("N S0 D"))
    b = (parse("1 S0 D"), parse("5 S0 D"))
    c, ra, rb = join([a, b], ("or", (0, 1)))
    assert tokens_str(c) == "1 S0 D"
    assert tokens_str(ra) == "N S0 D"


def test_reduce_keeps_lockstep_with_parent():
    """Spec: empty fibers reduce to nothing. We emit 0 for an element's empty fiber so that the
    result stays aligned with the other streams of the parent level (fused consumers)."""
    vals = parse("1 2 S0 S0 3 S1 D", values=True)
    parent = parse("0 1 2 S0 D")
    p = Prim(0, "reduce", (), (), (("op", "sum"), ("extent", 3)))
    (out,) = FUNCS["reduce"](p, [vals, parent], {})
    assert tokens_str(out) == "3 0 3 S0 D"
    p = Prim(0, "reduce", (), (), (("op", "max"), ("extent", 3)))
    (out,) = FUNCS["reduce"](p, [parse("-1 -2 -5 S0 -4 S1 D", values=True), parse("0 1 S0 D")], {})
    assert tokens_str(out) == "-1 0 S0 D"  # row 1 has implicit zeros: its max is 0


def test_sparse_accumulator_sums_by_inner_coordinate():
    # i-level parent, k then j: accumulate over k keeping j
    parent = parse("0 1 S0 D")
    ck = parse("0 1 S0 2 S1 D")
    cj = parse("0 3 S0 3 S1 1 S2 D")
    vals = parse("1 2 S0 4 S1 8 S2 D", values=True)
    p = Prim(0, "spacc", (), (), (("op", "sum"), ("reduced", (0,)), ("sizes", (3, 4)), ("tile", ())))
    (st,) = FUNCS["spacc"](p, [vals, ck, cj, parent], {})
    dense = S.to_dense(st)
    assert dense.tolist() == [[1, 0, 0, 6], [0, 8, 0, 0]]


@pytest.mark.parametrize("fmt", ["dense", "csr", "dcsr", "csc", "dcsc", "cd", "dc@10"])
def test_storage_round_trip(fmt):
    from stitchflow.ir.types import parse_format

    g = torch.Generator().manual_seed(3)
    t = torch.where(torch.rand(5, 7, generator=g) < 0.3, torch.randn(5, 7, generator=g), torch.zeros(()))
    f = parse_format(fmt, 2)
    st = S.from_torch(t, tuple(str(lv) for lv in f.levels), f.mode_order)
    assert np.allclose(S.to_dense(st), t.numpy().transpose(f.mode_order))


def test_blocked_storage_round_trip():
    t = torch.zeros(64, 32)
    t[16:32, 0:16] = torch.randn(16, 16)
    t[48:64, 16:32] = torch.randn(16, 16)
    st = S.from_torch(t, ("d", "c"), (0, 1), (16, 16))
    assert st.values.shape == (2, 16, 16)
    assert np.allclose(S.to_dense(st), t.numpy())


def _peak_rss_growth(fn) -> int:
    """Bytes the process's peak resident memory grew by while fn ran (Linux: VmHWM, reset first)."""
    def hwm():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = hwm()
    fn()
    return hwm() - before


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/clear_refs"), reason="needs Linux's peak RSS reset")
@pytest.mark.parametrize("mode_order", [(0, 1), (1, 0)])
def test_a_dense_load_makes_one_float64_copy(mode_order):
    """A dense tensor is stored as one float64 array in its levels' order, converted and permuted in
    one pass: MAG's 736,389 x 349 float32 class-layer tensors, loaded column first, took three
    2 GB copies at once (converted, then reshaped and copied by from_dense)."""
    t = torch.randn(3000, 2000)
    st = None

    def load():
        nonlocal st
        st = S.from_torch(t, ("d", "d"), mode_order)
    growth = _peak_rss_growth(load)
    assert np.array_equal(st.values, t.double().numpy().transpose(mode_order).reshape(-1))
    assert not np.may_share_memory(st.values, t.numpy())
    assert growth < 1.5 * st.values.nbytes
