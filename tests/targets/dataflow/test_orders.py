"""Dataflow orders: the legal ones all run and agree, illegal ones are refused with a reason."""

import itertools

import pytest
import torch

import stitchflow
from conftest import assert_close
from stitchflow.ir.errors import StitchflowError
from stitchflow.targets.dataflow import dataflows, describe
from stitchflow.targets.dataflow.order import constraints, legal_orders


def sparse(shape, density, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.where(torch.rand(shape, generator=g) < density, torch.rand(shape, generator=g) + 0.5, torch.zeros(()))


def karate_like(n=34, seed=0):
    a = sparse((n, n), 0.1, seed)
    return ((a + a.t()) > 0).float()


def abc(a, b, c):
    return a @ b @ c


def _orders(fn, ins, formats):
    prog = stitchflow.compile(fn, ins, target="dataflow", fusion="full", formats=formats)
    (compiled,) = prog._compiled
    (expr,) = compiled.exprs.values()
    return prog, list(legal_orders(constraints(expr, prog.graph)))


def test_every_order_of_abc_all_dcsr_agrees():
    """FuseFlow's order study: A·B·C, all DCSR, 90% sparse (karate-club-sized)."""
    ins = (karate_like(), sparse((34, 34), 0.1, 1), sparse((34, 34), 0.1, 2))
    formats = {0: "dcsr", 1: "dcsr", 2: "dcsr"}
    _, orders = _orders(abc, ins, formats)
    assert len(orders) >= 1
    expected = abc(*ins)
    for k, order in enumerate(orders):
        for spec in (k, order):
            prog = stitchflow.compile(abc, ins, target="dataflow", fusion="full", formats=formats,
                                      options={"order": spec, "hoist": False})
            assert dataflows(prog)[0].order == order
            assert_close(prog(*ins), expected)


def test_every_order_of_abc_with_dense_operands_agrees():
    """Dense operands impose no order, so there are many more orders; a sample of them."""
    ins = (sparse((9, 7), 0.3, 1), torch.randn(7, 5), sparse((5, 6), 0.4, 2))
    formats = {0: "dcsr", 2: "dcsc"}
    _, orders = _orders(abc, ins, formats)
    assert len(orders) > 5
    expected = abc(*ins)
    for order in orders[:: max(1, len(orders) // 12)]:
        for hoist in (True, False):
            prog = stitchflow.compile(abc, ins, target="dataflow", fusion="full", formats=formats,
                                      options={"order": order, "hoist": hoist})
            assert_close(prog(*ins), expected)


def test_illegal_order_is_refused_with_reason():
    ins = (sparse((5, 5), 0.5, 1), sparse((5, 5), 0.5, 2))
    with pytest.raises((StitchflowError, ValueError), match="stored dcsr"):
        stitchflow.compile(lambda a, b: a @ b, ins, target="dataflow", fusion="full",
                           formats={0: "dcsr", 1: "dcsr"}, options={"order": ("k", "i", "j")})
    with pytest.raises((StitchflowError, ValueError), match="once each"):
        stitchflow.compile(lambda a, b: a @ b, ins, target="dataflow", fusion="full",
                           formats={0: "dcsr", 1: "dcsr"}, options={"order": ("i", "j")})


def test_conflicting_storage_orders_are_reformatted():
    a, b = sparse((6, 6), 0.4, 1), sparse((6, 6), 0.4, 2)
    prog = stitchflow.compile(lambda a, b: a + b, (a, b), target="dataflow", fusion="full",
                              formats={0: "csr", 1: "csc"})
    assert "reformatted" in describe(prog)
    assert_close(prog(a, b), a + b)


def test_sparse_index_arithmetic_is_refused():
    from stitchflow.targets.dataflow import TARGET

    a = sparse((8, 8), 0.5, 1)
    prog = stitchflow.compile(lambda a: a[::2] * 2.0, (a,), target="reference", formats={0: "dcsr"})
    why = [TARGET.check_region(prog.graph, r) for r in prog.regions]
    assert any(w and "index arithmetic" in w for w in why), why


@pytest.mark.parametrize("hoist", [True, False])
def test_default_order_is_estimated_cheapest(hoist):
    ins = (sparse((20, 20), 0.2, 1), torch.randn(20, 30), sparse((30, 4), 0.5, 2))
    prog = stitchflow.compile(abc, ins, target="dataflow", fusion="full", formats={0: "csr", 2: "dcsr"},
                              options={"hoist": hoist})
    assert "estimated" in describe(prog)
    assert_close(prog(*ins), abc(*ins))
