"""Copies that only reorder elements, seen as strided views of their result (targets/gpu/layout.py):
the strides against torch's own view of the same reordering, and the copies that are not views."""

import math

import torch
from hypothesis import given, settings, strategies as st

from stitchflow.ir.expr import Access, Read
from stitchflow.ir.graph import Node
from stitchflow.ir.index import Div, Lit, Mod, Sum, Var
from stitchflow.targets.gpu.layout import copy_strides


def copy_node(index, reads, dims):
    return Node("y", tuple(Var(v) for v in index), Read(Access("x", tuple(reads))), tuple(dims))


def test_merged_heads_are_a_view_of_the_result():
    """out[i, j, l] = o[0, l // 8, j, l % 8]: o (1, H, S, 8) transposed and flattened into (1, S, 8·H)."""
    H, S, D = 3, 5, 8
    node = copy_node("ijl", [Lit(0), Div(Var("l"), D), Var("j"), Mod(Var("l"), D)],
                     [("i", 1), ("j", S), ("l", H * D)])
    strides = copy_strides(node, (1, H, S, D))
    y = torch.arange(S * H * D).view(1, S, H * D)
    o = y.as_strided((1, H, S, D), strides)
    assert torch.equal(o.transpose(1, 2).flatten(-2), y)


def test_permutes_and_splits_into_three_digits():
    # y[a, b] = x[b % 2, a, (b // 2) % 3, b // 6]: b (extent 24) read as three digits
    node = copy_node("ab", [Mod(Var("b"), 2), Var("a"), Mod(Div(Var("b"), 2), 3), Div(Var("b"), 6)],
                     [("a", 5), ("b", 24)])
    strides = copy_strides(node, (2, 5, 3, 4))
    y = torch.arange(5 * 24).view(5, 24)
    x = y.as_strided((2, 5, 3, 4), strides)
    a, b = torch.meshgrid(torch.arange(5), torch.arange(24), indexing="ij")
    assert torch.equal(x[b % 2, a, (b // 2) % 3, b // 6], y)


def test_copies_that_are_not_views():
    dims = [("a", 4), ("b", 4)]
    assert copy_strides(copy_node("ab", [Var("a"), Var("a")], dims), (4, 4)) is None  # a diagonal
    assert copy_strides(copy_node("ab", [Var("a")], dims), (4,)) is None  # a broadcast
    assert copy_strides(copy_node("ab", [Var("b"), Sum(((1, Var("a")),), 1)], dims), (4, 5)) is None  # a shift
    # b // 2 is not b's top digit when b % 2 is missing
    assert copy_strides(copy_node("ab", [Var("a"), Div(Var("b"), 2), Lit(0)], dims), (4, 2, 2)) is None
    # the digit b % 2 read, its weight-2 digit as b // 2 (unbounded) but then a further digit
    node = copy_node("ab", [Mod(Var("b"), 2), Div(Var("b"), 2), Var("a")], [("a", 4), ("b", 8)])
    assert copy_strides(node, (2, 4, 4)) is not None
    assert copy_strides(copy_node("ab", [Div(Var("b"), 2), Mod(Var("b"), 4), Var("a")], [("a", 4), ("b", 8)]),
                        (4, 4, 4)) is None  # overlapping digits



def _digits_node(shape, perm, groups):
    """The IR copy y = x.permute(perm).reshape(merged groups of consecutive permuted dims), reading x through
    the digits of y's variables, as the frontend writes a reshape: (v // inner) % extent, the top digit without
    the modulus, the lowest without the division."""
    reads, dims, k = [None] * len(shape), [], 0
    for g, size in enumerate(groups):
        members = perm[k:k + size]
        k += size
        extent = 1
        for d in members:
            extent *= shape[d]
        dims.append((f"v{g}", extent))
        inner = extent
        for pos, d in enumerate(members):
            inner //= shape[d]
            index = Var(f"v{g}") if inner == 1 else Div(Var(f"v{g}"), inner)
            if pos > 0:
                index = Mod(index, shape[d])
            reads[d] = index
    return copy_node([v for v, _ in dims], reads, dims), tuple(e for _, e in dims)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.randoms(use_true_random=False))
def test_any_permute_and_reshape_is_a_view(shape, rnd):
    """Hypothesis: every x.permute(p).reshape(merging consecutive dims) comes back as strides under which the
    contiguous result, seen as x, is x (extent-1 dims included)."""
    perm = list(range(len(shape)))
    rnd.shuffle(perm)
    groups, left = [], len(shape)
    while left:
        groups.append(rnd.randint(1, left))
        left -= groups[-1]
    node, y_shape = _digits_node(shape, perm, groups)
    x = torch.arange(math.prod(shape)).view(shape)
    y = x.permute(perm).reshape(y_shape).contiguous()
    strides = copy_strides(node, tuple(shape))
    assert strides is not None
    assert torch.equal(y.as_strided(tuple(shape), strides), x)
