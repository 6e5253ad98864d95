"""Two-operand contractions as one bmm over strided views (targets/gpu/batched_gemm): equal to
torch.einsum for any equation and operand layout, and copy-free for the layouts attention's
contractions meet in a Llama block (head splits, GQA groups, transposed keys)."""

import string

import pytest
import torch
from hypothesis import given, settings, strategies as st

from stitchflow.targets.gpu.batched_gemm import (OperandView, _matrices, contiguous, cublas_reads, merged_stride,
                                                 plan_bmm, run_bmm)
from conftest import assert_close


def _plan(eq, a, b):
    return plan_bmm(eq, (tuple(a.shape), tuple(b.shape)), (a.stride(), b.stride()))


def _strided(sizes, storage_order, gen, dtype=torch.float64, offset=0, broadcast=()):
    """A tensor of `sizes` laid out in memory in `storage_order` (outermost first), starting
    `offset` elements into a larger buffer, with the dims in `broadcast` expanded from size 1."""
    stored = [1 if d in broadcast else sizes[d] for d in storage_order]
    flat = torch.randn(offset + max(1, torch.Size(stored).numel()), generator=gen, dtype=torch.float64).to(dtype)
    t = flat[offset:offset + torch.Size(stored).numel()].view(stored)
    t = t.permute([storage_order.index(d) for d in range(len(sizes))])
    return t.expand(sizes)


@st.composite
def contractions(draw):
    """An equation of two operands over 1-6 letters, each letter a batch, row, column or summed
    letter, with random extents (1 among them) and random memory orders, offsets and broadcasts."""
    n = draw(st.integers(1, 6))
    letters = string.ascii_lowercase[:n]
    roles = {c: draw(st.sampled_from(["batch", "rows", "cols", "summed"])) for c in letters}
    sizes = {c: draw(st.sampled_from([1, 2, 3, 5])) for c in letters}
    a = [c for c in letters if roles[c] in ("batch", "rows", "summed")]
    b = [c for c in letters if roles[c] in ("batch", "cols", "summed")]
    out = [c for c in letters if roles[c] != "summed"]
    a, b, out = (draw(st.permutations(x)) for x in (a, b, out))
    operands = []
    for spec in (a, b):
        order = draw(st.permutations(range(len(spec))))
        broadcast = draw(st.sets(st.sampled_from(range(len(spec))), max_size=1)) if spec else set()
        operands.append((tuple(sizes[c] for c in spec), list(order), draw(st.integers(0, 3)), broadcast))
    return f"{''.join(a)},{''.join(b)}->{''.join(out)}", operands


@settings(max_examples=300, deadline=None)
@given(contractions())
def test_any_equation_and_layout_equals_einsum(case):
    eq, operands = case
    gen = torch.Generator().manual_seed(0)
    a, b = (_strided(list(sizes), order, gen, offset=offset, broadcast=bc) for sizes, order, offset, bc in operands)
    plan = _plan(eq, a, b)
    assert plan is not None, eq
    out = run_bmm(plan, a, b)
    assert out.shape == torch.einsum(eq, a, b).shape
    assert_close(out, torch.einsum(eq, a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_half_and_single_precision_equal_einsum(dtype):
    gen = torch.Generator().manual_seed(1)
    q = _strided([2, 4, 17, 8], [2, 0, 1, 3], gen, dtype)  # (g, r, s, d) stored (s, g, r, d)
    k = _strided([2, 13, 8], [1, 0, 2], gen, dtype)
    assert_close(run_bmm(_plan("grsd,gtd->grst", q, k), q, k), torch.einsum("grsd,gtd->grst", q, k))


def _reads_in_place(view_of, t):
    return view_of.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


# A Llama block's attention at a small size: 8 query heads in 2 GQA groups of 4, head dim 8, 16 tokens.
G, R, S, D = 2, 4, 16, 8


def _heads(gen):
    """q as the RoPE kernel leaves it ([1, heads, s, d] contiguous, seen as (g, r, s, d)); k and v
    as the projections leave them ([s, groups * d], seen as (g, t, d)); probabilities (g, r, s, t)."""
    q = torch.randn(G * R, S, D, generator=gen, dtype=torch.float64).view(G, R, S, D)
    k = torch.randn(S, G * D, generator=gen, dtype=torch.float64).view(S, G, D).permute(1, 0, 2)
    v = torch.randn(S, G * D, generator=gen, dtype=torch.float64).view(S, G, D).permute(1, 0, 2)
    p = torch.randn(G, R, S, S, generator=gen, dtype=torch.float64)
    return q, k, v, p


@pytest.mark.parametrize("eq,operands", [
    ("grsd,gtd->grst", "qk"),  # scores
    ("grst,gtd->grsd", "pv"),  # probabilities times values
    ("grst,grsd->gtd", "pq"),  # a key gradient: dS^T q, summed over the group's heads
    ("grst,grsd->gdt", "pq"),  # the same, transposed out (the operands swap roles)
    ("grst,grsd->gtd", "pk"),  # not a real one; k broadcast over r: (g, r) cannot merge, so k is copied
])
def test_attention_layouts_read_in_place(eq, operands):
    gen = torch.Generator().manual_seed(2)
    q, k, v, p = _heads(gen)
    named = dict(q=q, k=k, v=v, p=p)
    if operands == "pk":
        a, b = p, k.unsqueeze(1).expand(G, R, S, D)
    else:
        a, b = named[operands[0]], named[operands[1]]
    plan = _plan(eq, a, b)
    out = run_bmm(plan, a, b)
    assert_close(out, torch.einsum(eq, a, b))
    assert out.is_contiguous(), plan  # no copy of the product either
    left, right = (b, a) if plan.swapped else (a, b)
    if operands == "pk":
        assert (plan.left.copy, plan.right.copy) == (False, True), plan
        assert not _reads_in_place(_matrices(right, plan.right), right)
    else:
        assert plan.copied == 0, plan
        for t, view in ((left, plan.left), (right, plan.right)):
            assert _reads_in_place(_matrices(t, view), t)


def test_query_in_projection_layout_copied_once_and_coalesced():
    """q straight from its projection, stored (s, g, r, d): (r, s) cannot be one row dim, so q is
    copied, with d (its contiguous dim) kept innermost; k is read in place."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(S, G * R * D, generator=gen, dtype=torch.float64).view(S, G, R, D).permute(1, 2, 0, 3)
    _, k, _, _ = _heads(gen)
    plan = _plan("grsd,gtd->grst", q, k)
    assert (plan.left.copy, plan.left.inner, plan.right.copy) == (True, "cols", False), plan
    assert_close(run_bmm(plan, q, k), torch.einsum("grsd,gtd->grst", q, k))


def test_refused_equations():
    assert plan_bmm("ii,ij->j", ((3, 3), (3, 4)), ((3, 1), (4, 1))) is None  # a diagonal
    assert plan_bmm("ij,jk->k", ((3, 3), (3, 4)), ((3, 1), (4, 1))) is None  # i summed within one operand
    assert plan_bmm("ij,jk,kl->il", ((2, 2),) * 3, ((2, 1),) * 3) is None


def test_strides_and_matrices():
    assert merged_stride((4, 3), (3, 1)) == 1
    assert merged_stride((4, 3), (1, 4)) is None
    assert merged_stride((4, 1, 3), (3, 99, 1)) == 1  # size-1 dims do not count
    assert merged_stride((), ()) == 0
    assert cublas_reads(4, 5, 5, 1) and cublas_reads(4, 5, 1, 4) and cublas_reads(4, 5, 1, 8)
    assert not cublas_reads(4, 5, 5, 2) and not cublas_reads(4, 5, 3, 1)
    view = OperandView((0, 1, 2), ((2,), (3,), (4,)), True, "rows")
    assert str(view) == "[2 3 4] copied, rows inner"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.bool])
@pytest.mark.parametrize("shape,perm,offset", [((4, 6, 8), (1, 0, 2), 0), ((4, 6, 8), (1, 0, 2), 2),
                                               ((4, 6, 6), (1, 0, 2), 0), ((3, 1, 8), (1, 0, 2), 0),
                                               ((4, 6, 8), (2, 0, 1), 0), ((5,), (0,), 1)])
def test_contiguous_moves_words(dtype, shape, perm, offset):
    """contiguous(t) equals t.contiguous() bit for bit, whether or not wider words fit the layout
    (odd offsets, rows not a whole number of words, a transposed innermost dim, 1-byte types)."""
    gen = torch.Generator().manual_seed(4)
    flat = (torch.randn(offset + torch.Size(shape).numel(), generator=gen) * 50).to(dtype)
    t = flat[offset:].view(shape).permute(perm)
    out = contiguous(t)
    assert out.is_contiguous() and out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out, t.contiguous())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS's reading of strided operands needs a CUDA GPU")
@settings(max_examples=100, deadline=None)
@given(contractions(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_any_equation_and_layout_on_cuda(case, dtype):
    eq, operands = case
    gen = torch.Generator().manual_seed(5)
    a, b = (_to_cuda_keeping_layout(_strided(list(sizes), order, gen, dtype, offset, bc))
            for sizes, order, offset, bc in operands)
    assert_close(run_bmm(_plan(eq, a, b), a, b), torch.einsum(eq, a, b))


def _to_cuda_keeping_layout(t):
    """`t` on the GPU with the same sizes, strides and storage offset."""
    n = t.untyped_storage().nbytes() // t.element_size()
    whole = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (n,), (1,))
    return whole.cuda().as_strided(t.shape, t.stride(), t.storage_offset())


def test_odd_output_columns_are_computed_into_aligned_rows(monkeypatch):
    """GPT-2's logits (50257 columns): the weight padded to 16 bytes of columns (in its own layout) for
    cuBLAS, the product's padded rows kept."""
    from stitchflow.targets.gpu import batched_gemm

    monkeypatch.setattr(batched_gemm, "MIN_PADDED", 0)
    a, w = torch.randn(6, 16).to(torch.bfloat16), torch.randn(50, 16).to(torch.bfloat16)
    plan = _plan("ik,jk->ij", a, w)
    out = run_bmm(plan, a, w)
    assert out.stride() == (56, 1) and batched_gemm.row_padded(out)
    assert_close(out, torch.einsum("ik,jk->ij", a, w))
    assert not batched_gemm.row_padded(out.contiguous()) and not batched_gemm.row_padded(out.t())
    assert batched_gemm.padded_right(a[None], w.t()[None][..., :48]) is None  # 48 columns are aligned
    wide = batched_gemm.padded_right(a[None], w.t()[None])
    assert wide.shape == (1, 16, 56) and wide.stride()[1:] == (1, 16) and not wide[..., 50:].any()


def test_padded_logits_feed_the_programs_kernels(monkeypatch):
    """The padded logits go on to the generated kernels (a log-softmax and a gather, as in cross entropy) and
    out to the caller without a copy."""
    import os

    import stitchflow
    from stitchflow.targets.gpu import batched_gemm

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the gpu target on CPU tensors needs the Triton interpreter")
    monkeypatch.setattr(batched_gemm, "MIN_PADDED", 0)

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 50, bias=False)

        def forward(self, x, labels):
            logits = self.proj(x)
            return logits, torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).mean()

    torch.manual_seed(0)
    model = Head().to(torch.bfloat16)
    x, labels = torch.randn(3, 5, 16).to(torch.bfloat16), torch.randint(0, 50, (3, 5))
    prog = stitchflow.compile(model, (x, labels), target="gpu", fusion="auto")
    logits, loss = prog(x, labels)
    want_logits, want_loss = model(x, labels)
    assert_close(logits, want_logits)
    assert_close(loss, want_loss)
