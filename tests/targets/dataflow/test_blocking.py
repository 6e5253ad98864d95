"""Sparsity blocking (options block=b): values are b x b tiles, coordinates block indices; the
blocked graphs agree with the plain scalar graph and emit one token per tile, not per scalar."""

import pytest
import torch

import stitchflow
from stitchflow.apps import APPS, GPT3Decoder
from stitchflow.targets.dataflow import dataflows
from stitchflow.targets.dataflow.order import constraints, legal_orders
from stitchflow.targets.dataflow.target import CompiledRegion, _plan


def block_sparse(shape, b, density, seed):
    """A matrix whose non-zeros lie in about `density` of its b x b blocks (half-full blocks)."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = -(-shape[0] // b), -(-shape[1] // b)
    mask = (torch.rand(rows, cols, generator=g) < density).repeat_interleave(b, 0).repeat_interleave(b, 1)
    mask = mask[: shape[0], : shape[1]] & (torch.rand(shape, generator=g) < 0.5)
    return torch.where(mask, torch.rand(shape, generator=g) + 0.5, torch.zeros(()))


def compile_run(fn, ins, formats=None, fusion="full", **options):
    prog = stitchflow.compile(fn, ins, target="dataflow", fusion=fusion, formats=formats, options=options)
    out = prog(*ins)
    tokens = sum(c.tokens for c in prog._compiled if isinstance(c, CompiledRegion))
    return prog, out, tokens


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("b", [16, 32, 64])
@pytest.mark.parametrize("shape", [(128, 64, 64), (100, 70, 40)])
@pytest.mark.parametrize("fmt", ["csr", "dcsr"])
def test_spmm_blocked_agrees_with_scalar(b, shape, fmt):
    m, k, n = shape
    a, x = block_sparse((m, k), b, 0.3, 1), torch.randn(k, n)
    fn = lambda a, x: a @ x  # noqa: E731
    _, plain, t_plain = compile_run(fn, (a, x), {0: fmt})
    prog, out, t_block = compile_run(fn, (a, x), {0: fmt}, block=b)
    close(out, plain)
    close(out, a @ x)
    assert t_block * 8 < t_plain  # one token per tile
    alus = [p for p in dataflows(prog)[0].prims if p.kind == "alu"]
    assert any(p.param("contract") == ("k",) or p.param("contract") for p in alus)  # tile multiply


def test_bsr_input_is_read_as_tiles():
    a, x = block_sparse((64, 48), 16, 0.4, 3), torch.randn(48, 32)
    bsr = a.to_sparse_bsr((16, 16))
    prog, out, _ = compile_run(lambda a, x: a @ x, (bsr, x), block=16)
    close(out, a @ x)
    load = [p for p in dataflows(prog)[0].prims if p.kind == "load" and p.param("tile") == (16, 16)]
    assert load and load[0].param("kinds") == ("d", "c")


@pytest.mark.parametrize("b", [16, 32])
@pytest.mark.parametrize("fmts", [{0: "dcsr", 1: "dcsr", 2: "dcsr"}, {0: "dcsr", 1: "csr", 2: "dense"}])
@pytest.mark.parametrize("hoist", [True, False])
def test_abc_chain_blocked_legal_orders(b, fmts, hoist):
    """Every legal order (a sample of at most 6 where dense operands allow many) agrees."""
    ins = (block_sparse((64, 96), b, 0.3, 1), block_sparse((96, 64), b, 0.3, 2), block_sparse((64, 32), b, 0.5, 3))
    fn = lambda a, b_, c: a @ b_ @ c  # noqa: E731
    prog = stitchflow.compile(fn, ins, target="dataflow", fusion="full", formats=fmts)
    (name, (expr, *_)), = [(k, v) for k, v in _plan(prog.graph, prog.regions[0], {})[0].items()]
    orders = list(legal_orders(constraints(expr, prog.graph)))
    for order in orders[:: max(1, len(orders) // 6)]:
        _, plain, t_plain = compile_run(fn, ins, fmts, order=order, hoist=hoist)
        _, out, t_block = compile_run(fn, ins, fmts, order=order, hoist=hoist, block=b)
        close(out, plain)
        assert t_block * 8 < t_plain, (order, t_block, t_plain)


def test_abc_chain_blocked_with_parallel_lanes():
    ins = (block_sparse((64, 64), 16, 0.3, 1), block_sparse((64, 64), 16, 0.3, 2), block_sparse((64, 32), 16, 0.5, 3))
    fn = lambda a, b_, c: a @ b_ @ c  # noqa: E731
    _, plain, _ = compile_run(fn, ins, {0: "dcsr", 1: "dcsr", 2: "dcsr"})
    _, out, _ = compile_run(fn, ins, {0: "dcsr", 1: "dcsr", 2: "dcsr"}, block=16, par={"i": 2})
    close(out, plain)


def test_a_times_b_plus_c_blocked():
    ins = (block_sparse((64, 64), 16, 0.3, 1), block_sparse((64, 48), 16, 0.3, 2), block_sparse((64, 48), 16, 0.3, 4))
    fn = lambda a, b_, c: a @ (b_ + c)  # noqa: E731
    _, plain, _ = compile_run(fn, ins, {0: "dcsr", 1: "dcsr", 2: "csr"})
    _, out, _ = compile_run(fn, ins, {0: "dcsr", 1: "dcsr", 2: "csr"}, block=16)
    close(out, plain)


@pytest.mark.parametrize("b", [16, 32])
def test_masked_softmax_over_block_mask(b):
    s = 128
    mask = block_sparse((s, s), b, 0.3, 5) != 0
    mask |= torch.eye(s, dtype=torch.bool)
    scores = torch.randn(s, s)
    fn = lambda x, m: torch.softmax(x.masked_fill(~m, float("-inf")), dim=-1)  # noqa: E731
    _, plain, t_plain = compile_run(fn, (scores, mask))
    _, out, t_block = compile_run(fn, (scores, mask), block=b)
    close(out, plain)
    assert t_block * 8 < t_plain


def test_row_and_column_reductions_blocked():
    a = block_sparse((64, 48), 16, 0.4, 6)
    for fn in (lambda a: a.sum(dim=1), lambda a: a.sum(dim=0), lambda a: a.amax(dim=1), lambda a: a.sum()):
        _, plain, _ = compile_run(fn, (a,), {0: "dcsr"})
        _, out, _ = compile_run(fn, (a,), {0: "dcsr"}, block=16)
        close(out, plain)


def test_padding_is_refused_for_max_and_non_zero_bodies():
    """Extents b does not divide are padded with zeros only where that cannot change a
    reduction: a max, or a sum of exp (exp(0) = 1), over such a variable keeps it scalar."""
    a = -block_sparse((40, 24), 16, 0.5, 7) - 1.0
    for fn in (lambda a: a.amax(dim=1), lambda a: torch.exp(a).sum(dim=1), lambda a: torch.softmax(a, dim=-1)):
        _, plain, _ = compile_run(fn, (a,))
        _, out, _ = compile_run(fn, (a,), block=16)
        close(out, plain)
        close(out, fn(a))


@pytest.mark.parametrize("fusion", ["unfused", "partial", "full"])
@pytest.mark.parametrize("b", [16, 32])
def test_gpt3_bigbird_attention_blocked(b, fusion):
    torch.manual_seed(0)
    model = GPT3Decoder(width=32, heads=2, ffn=64, seq=256, block=b).eval()
    x = torch.randn(256, 32)
    _, plain, t_plain = compile_run(model, (x,), fusion=fusion)
    _, out, t_block = compile_run(model, (x,), fusion=fusion, block=b)
    close(out, plain)
    close(out, model(x))
    assert t_block * 4 < t_plain


def test_gpt3_bigbird_app_blocked():
    model, inputs = APPS["gpt3-bigbird"].build(size="small", block=16)
    _, out, _ = compile_run(model, inputs, fusion="partial", block=16)
    close(out, model(*inputs))


@pytest.mark.parametrize("fusion", ["unfused", "full"])
def test_gcn_small_blocked(fusion):
    model, inputs = APPS["gcn"].build(size="small")
    _, plain, t_plain = compile_run(model, inputs, fusion=fusion)
    _, out, t_block = compile_run(model, inputs, fusion=fusion, block=16)
    close(out, plain)
    close(out, model(*inputs))
    assert t_block < t_plain


def test_block_must_be_16_32_or_64():
    with pytest.raises(Exception, match="block must be"):
        compile_run(lambda a: a.sum(), (torch.ones(4, 4),), block=8)
