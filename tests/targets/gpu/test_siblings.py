"""GEMMs that share their input, as one grouped launch (siblings.py), on CPU tensors under the Triton interpreter."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import stitchflow
from stitchflow.targets.gpu.chain_match import match_gemm_epilogues
from stitchflow.targets.gpu.siblings import SiblingGemms, grouped_gemm, match_siblings

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter tests on CPU tensors (forcing the interpreter here would switch "
                                "a GPU session's other tests to it too)")

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def rand(*shape, dtype=torch.float32, seed=[0]):
    seed[0] += 1
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed[0])).to(dtype)


def qkv(x, wq, bq, wk, bk, wv, bv):
    """Attention's three projections of one input, then something that reads all three (no projection's
    bias add followed by an activation or a residual add, which would make it a GEMM epilogue of its own)."""
    return torch.tanh(F.linear(x, wq, bq)) * F.linear(x, wk, bk) + torch.sin(F.linear(x, wv, bv))


def gqa_no_bias(x, wq, wk, wv):
    """Llama's projections: no biases, key and value narrower than the query."""
    q, k, v = x @ wq.t(), x @ wk.t(), x @ wv.t()
    return q[..., :k.shape[-1]] * k - torch.sin(v)


def mixed(x, w1, b1, w2, w3, b3, y, w4):
    """Only GEMMs of the same input, with the same epilogue kind, are siblings: w1 and w3 (bias), not w2 (relu
    after it), not w4 (another input)."""
    return torch.sin(F.linear(x, w1, b1)) * torch.relu(F.linear(x, w2)) * torch.cos(F.linear(x, w3, b3)) \
        - torch.sin(y @ w4)


def compiled_steps(prog):
    return [s for run in prog.compiled for s in getattr(run, "steps", ())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n,biases", [(37, 45, (70, 19, 33), True), (5, 64, (64, 64), False),
                                          (1, 17, (3, 1, 130, 9), True)])
def test_grouped_gemm_equals_each_product(m, k, n, biases, dtype):
    a = rand(m, k, dtype=dtype)
    weights = [rand(w, k, dtype=dtype).t() for w in n]  # linear weights read transposed, as the program does
    bias = [rand(w, dtype=dtype) for w in n] if biases else None
    outs = grouped_gemm(a, weights, bias, [dtype] * len(n), exact_fp32=True)
    for g, out in enumerate(outs):
        ref = a.double() @ weights[g].double() + (bias[g].double() if biases else 0)
        assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
        assert rel_err(out, ref) < TOL[dtype]


def test_grouped_gemm_refuses_a_weight_of_another_length():
    with pytest.raises(ValueError, match="every weight must have 8 rows"):
        grouped_gemm(rand(4, 8), [rand(8, 3), rand(9, 3)], None, [torch.float32] * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_projections_run_as_one_grouped_launch(dtype):
    d = 24
    args = [rand(2, 7, d, dtype=dtype)] + [t for _ in range(3) for t in (rand(d, d, dtype=dtype), rand(d, dtype=dtype))]
    prog = stitchflow.compile(qkv, args, target="gpu", fusion="full")
    groups = [s for s in compiled_steps(prog) if isinstance(s, SiblingGemms)]
    assert len(groups) == 1 and len(groups[0].group.members) == 3
    assert rel_err(prog(*args), qkv(*[a.double() for a in args])) < TOL[dtype] * 2
    one_by_one = stitchflow.compile(qkv, args, target="gpu", fusion="full", options={"sibling_gemms": False})
    assert not any(isinstance(s, SiblingGemms) for s in compiled_steps(one_by_one))
    assert rel_err(one_by_one(*args), qkv(*[a.double() for a in args])) < TOL[dtype] * 2


def test_gemms_without_bias_of_several_widths():
    x = rand(3, 5, 32)
    args = [x, rand(32, 32), rand(8, 32), rand(8, 32)]
    prog = stitchflow.compile(gqa_no_bias, args, target="gpu", fusion="full")
    (group,) = [s for s in compiled_steps(prog) if isinstance(s, SiblingGemms)]
    assert [m.bias for m in group.group.members] == [None] * 3
    assert rel_err(prog(*args), gqa_no_bias(*[a.double() for a in args])) < TOL[torch.float32]


def test_only_gemms_of_one_input_and_epilogue_kind_are_siblings():
    args = [rand(6, 10), rand(7, 10), rand(7), rand(7, 10), rand(7, 10), rand(7), rand(6, 4), rand(4, 7)]
    graph = stitchflow.compile(mixed, args).graph
    chains = match_gemm_epilogues(graph)
    (group,) = match_siblings(graph, tuple(n.name for n in graph.nodes), chains)
    assert [m.gemm.w for m in group.members] == [graph.inputs[1], graph.inputs[4]]  # w1 and w3, in graph order
    assert all(m.bias is not None for m in group.members)
    prog = stitchflow.compile(mixed, args, target="gpu", fusion="full")
    assert rel_err(prog(*args), mixed(*[a.double() for a in args])) < TOL[torch.float32]


def test_a_weight_written_in_place_is_read_fresh():
    d = 16
    args = [rand(4, d)] + [t for _ in range(3) for t in (rand(d, d), rand(d))]
    prog = stitchflow.compile(qkv, args, target="gpu", fusion="full")
    prog(*args)
    args[1].mul_(-2.0)  # the query's weight, updated as an optimizer would
    args[6].add_(1.0)   # the value's bias
    assert rel_err(prog(*args), qkv(*[a.double() for a in args])) < TOL[torch.float32]


@settings(max_examples=8, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 40), widths=st.lists(st.integers(1, 50), min_size=2, max_size=4))
def test_grouped_gemm_any_shape(m, k, widths):
    a = rand(m, k)
    weights = [rand(k, w) for w in widths]
    bias = [rand(w) for w in widths]
    for out, w, b in zip(grouped_gemm(a, weights, bias, [torch.float32] * len(widths), exact_fp32=True),
                         weights, bias):
        torch.testing.assert_close(out, a @ w + b, rtol=1e-5, atol=1e-5)


def test_explain_lists_the_groups():
    d = 16
    args = [rand(4, d)] + [t for _ in range(3) for t in (rand(d, d), rand(d))]
    text = stitchflow.compile(qkv, args, target="gpu", fusion="full").explain()
    lines = text[text.index("GEMMs of one input"):].splitlines()
    assert "siblings of x: linear_bias, linear_1_bias, linear_2_bias" in lines[1]


def test_bert_block_through_the_backend_groups_its_projections_and_sees_weights_change():
    """Through torch.compile the weights are parameters bound in place: the projections of the block's one input
    still group (query, key, value), and a weight written in place between calls is read as it is then."""
    from stitchflow import backend
    from stitchflow.apps import APPS

    model, inputs = APPS["bert"].build(size="small")
    model.eval()
    backend.COMPILED.clear()
    compiled = torch.compile(model, backend="stitchflow", dynamic=False, options={"target": "gpu"})
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-4, atol=1e-4)
        progs = [p for m in backend.COMPILED for p in m.programs.values() if p]
        groups = [s for p in progs for s in compiled_steps(p) if isinstance(s, SiblingGemms)]
        assert [len(g.group.members) for g in groups] == [3]
        model.attn.key.weight.mul_(-0.5)
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-4, atol=1e-4)
