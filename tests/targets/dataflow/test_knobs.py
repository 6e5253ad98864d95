"""Schedule knobs: parallel lanes (2, 4, 4x4) and sparsity blocking agree with the plain scalar graph."""

import pytest
import torch

import stitchflow
from conftest import assert_close
from stitchflow.apps import APPS, GPT3Decoder
from stitchflow.targets.dataflow import dataflows


def sparse(shape, density, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.where(torch.rand(shape, generator=g) < density, torch.rand(shape, generator=g) + 0.5, torch.zeros(()))


ABC = (sparse((30, 25), 0.2, 1), sparse((25, 20), 0.2, 2), sparse((20, 15), 0.3, 3))
FORMATS = {0: "dcsr", 1: "dcsr", 2: "dcsr"}


def run(fn, ins, formats=None, **options):
    prog = stitchflow.compile(fn, ins, target="dataflow", fusion="full", formats=formats, options=options)
    return prog, prog(*ins)


@pytest.mark.parametrize("par", [{"i": 2}, {"i": 4}, {"j": 3}, {"i": 4, "j": 4}])
@pytest.mark.parametrize("hoist", [True, False])
def test_parallel_abc_matches_scalar_graph(par, hoist):
    fn = lambda a, b, c: a @ b @ c  # noqa: E731
    _, plain = run(fn, ABC, FORMATS, hoist=hoist, order=("i", "k1", "k", "j"))
    prog, out = run(fn, ABC, FORMATS, hoist=hoist, order=("i", "k1", "k", "j"), par=par)
    assert torch.equal(out, plain)
    kinds = dataflows(prog)[0].counts()
    lanes = 1
    for p in par.values():
        lanes *= p
    assert kinds["fork"] >= 1 and kinds["join_lanes"] >= 1
    assert sum(1 for p in dataflows(prog)[0].prims if p.kind == "write") == 1
    assert len({p.lane for p in dataflows(prog)[0].prims if p.lane}) >= lanes


def test_parallel_lanes_are_balanced_round_robin():
    from stitchflow.targets.dataflow.parallel import fork, join_forked
    from stitchflow.targets.dataflow.stream import parse, tokens_str

    s = parse("0 1 2 S0 3 S0 S1 D")
    a, b = fork(s, 2)
    assert tokens_str(a) == "0 2 S0 S0 S1 D"
    assert tokens_str(b) == "1 S0 3 S0 S1 D"
    assert tokens_str(join_forked([a, b])) == tokens_str(s)


@pytest.mark.parametrize("par", [{"h": 2}, {"h": 2, "j": 4}])
def test_parallel_attention_region(par):
    torch.manual_seed(0)
    model = GPT3Decoder(width=32, heads=2, ffn=64, seq=64, block=16).eval()
    x = torch.randn(64, 32)
    # attention region: name the head variable "h" through an explicit order on every output
    plain = stitchflow.compile(model, (x,), target="dataflow", fusion="partial")
    attn = [df for df in dataflows(plain) if any(o.name == "matmul_1" for o in df.outputs)][0]
    head, row = attn.order[0], attn.order[1]
    mapping = {"h": head, "j": row}
    options = {"par": {mapping[k]: v for k, v in par.items()}}
    prog = stitchflow.compile(model, (x,), target="dataflow", fusion="partial", options=options)
    assert_close(prog(x), model(x))


def test_parallel_gcn_full():
    model, inputs = APPS["gcn"].build(size="small")
    prog = stitchflow.compile(model, inputs, target="dataflow", fusion="full", options={"par": {"i": 4}})
    torch.testing.assert_close(prog(*inputs), model(*inputs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block", [16, 32])
def test_blocked_abc_matches_scalar_graph(block):
    """Blocked variants (b = 16, 32) agree with the plain scalar graph (more in test_blocking)."""
    fn = lambda a, b, c: a @ b @ c  # noqa: E731
    plain_prog, plain = run(fn, ABC, FORMATS, order=("i", "k1", "k", "j"))
    prog, out = run(fn, ABC, FORMATS, order=("i", "k1", "k", "j"), block=block)
    assert_close(out, plain)
    loads = [p for p in dataflows(prog)[0].prims if p.kind == "load"]
    # extents 30, 25, 20 are padded to whole 16-tiles; shorter than one 32-tile, they stay scalar
    assert all((block in p.param("tile")) == (block == 16) for p in loads)
    tokens = lambda pr: sum(c.tokens for c in pr._compiled if hasattr(c, "tokens"))  # noqa: E731
    assert (tokens(prog) < tokens(plain_prog)) == (block == 16)


def test_bad_block_size_is_refused():
    with pytest.raises(Exception, match="block must be"):
        run(lambda a, b: a @ b, ABC[:2], {0: "dcsr", 1: "dcsr"}, block=8)
