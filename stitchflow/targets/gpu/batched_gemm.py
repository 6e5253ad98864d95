"""A two-operand contraction as one torch.bmm over strided views of its operands.

torch.einsum permutes each operand into (batch, kept, summed) in a fixed order and reshapes it,
which copies whenever those dims do not merge, and the copy runs through TensorIterator's generic
strided kernel: a Llama block's training step spent 152 µs of an H100's time in seven such copies
(attention's head splits, GQA groups and transposed keys), although cuBLAS could have read most of
those operands where they lay. Here:

- each operand's dims are grouped (batch, rows, cols) and ordered within a group so that they merge
  where the strides allow; either matrix order is accepted (cuBLAS reads transposed operands);
- the operands may swap roles (out^T = B^T A^T) so that the product comes back in the output's
  order, and among the orderings that are left the plan that copies the fewest elements wins;
- an operand that must still be copied is copied with its own fastest dim innermost (coalesced).

`plan_bmm` is a pure function of the equation and the operands' sizes and strides (legality: can a
group be one strided dim, is a matrix one cuBLAS reads in place); `run_bmm` executes a plan.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OperandView:
    """One operand as a [batch, rows, cols] matrix stack: `order` permutes its dims into group
    order, `groups` are the sizes of the three groups' dims; `copy` says it cannot be viewed so,
    and `inner` which group ("rows" or "cols") a copy keeps innermost."""

    order: tuple[int, ...]
    groups: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    copy: bool
    inner: str = "cols"
    strides: tuple[int, int, int] | None = None  # of the [batch, rows, cols] view, where it is one

    def __str__(self) -> str:
        dims = " ".join("x".join(map(str, g)) or "1" for g in self.groups)
        return f"[{dims}]{' copied, ' + self.inner + ' inner' if self.copy else ''}"


@dataclass(frozen=True)
class BmmPlan:
    """bmm(left, right) gives [batch, left rows, right cols]; `out_sizes` unflattens it into the
    groups' dims and `out_order` permutes those into the equation's output order."""

    left: OperandView
    right: OperandView
    swapped: bool  # the equation's second operand is the left matrix
    out_sizes: tuple[int, ...]
    out_order: tuple[int, ...]

    @property
    def copied(self) -> int:
        return sum(v.copy for v in (self.left, self.right))

    def __str__(self) -> str:
        permuted = "" if self.out_order == tuple(range(len(self.out_order))) else f" -> permute{self.out_order}"
        return f"bmm({self.left}, {self.right}){' swapped' if self.swapped else ''}{permuted}"


def merged_stride(sizes, strides) -> int | None:
    """The stride of dims `sizes` (outer first) taken as one dim, or None when they are not one
    evenly strided run. Dims of size 1 do not count."""
    dims = [(n, s) for n, s in zip(sizes, strides) if n != 1]
    if not dims:
        return 0
    for (_, outer), (n, inner) in zip(dims, dims[1:]):
        if outer != inner * n:
            return None
    return dims[-1][1]


def cublas_reads(rows: int, cols: int, row_stride: int, col_stride: int) -> bool:
    """Whether torch.bmm hands a [rows, cols] matrix with these strides to cuBLAS as it lies
    (one of the two dims contiguous, the other's stride at least the first's extent). A vector
    always can be (`_matrix_strides` gives its size-1 dim the stride that makes it so)."""
    if rows == 1 or cols == 1:
        return True
    return (col_stride == 1 and row_stride >= cols) or (row_stride == 1 and col_stride >= rows)


def _matrix_strides(rows: int, cols: int, row_stride: int, col_stride: int) -> tuple[int, int]:
    """A size-1 dim's stride set to what cuBLAS accepts with the other's (no element moves)."""
    if rows == 1 and cols == 1:
        return 1, 1
    if rows == 1:
        return (cols if col_stride == 1 else 1), col_stride
    if cols == 1:
        return row_stride, (rows if row_stride == 1 else 1)
    return row_stride, col_stride


def _view(sizes, strides, letters: str, groups: tuple[str, str, str]) -> OperandView:
    order = tuple(letters.index(c) for g in groups for c in g)
    dims = tuple(tuple(sizes[letters.index(c)] for c in g) for g in groups)
    merged = [merged_stride(d, [strides[letters.index(c)] for c in g]) for d, g in zip(dims, groups)]
    batch, rows, cols = (math.prod(d) for d in dims)
    copy = None in merged or not cublas_reads(rows, cols, merged[1], merged[2])
    moving = [c for c in letters if sizes[letters.index(c)] != 1 and strides[letters.index(c)] != 0]
    fastest = min(moving, key=lambda c: abs(strides[letters.index(c)]), default=None)
    inner = "rows" if fastest is not None and fastest in groups[1] else "cols"
    if copy:
        return OperandView(order, dims, True, inner)
    # size-1 dims take the strides cuBLAS accepts (they move no element)
    row_stride, col_stride = _matrix_strides(rows, cols, merged[1], merged[2])
    batch_stride = rows * cols if batch == 1 else merged[0]
    return OperandView(order, dims, False, inner, (batch_stride, row_stride, col_stride))


def _orders(group: list[str], strides, letters: str) -> list[str]:
    """Candidate orders of a group's letters: as given (the output's order), and outermost stride first."""
    by_stride = sorted(group, key=lambda c: -abs(strides[letters.index(c)]))
    return list(dict.fromkeys(("".join(group), "".join(by_stride))))


def plan_bmm(equation: str, sizes: tuple, strides: tuple) -> BmmPlan | None:
    """The cheapest bmm plan for a two-operand einsum `equation` over operands of these sizes and
    strides, or None where bmm does not express it (a letter twice in one operand, a letter summed
    within one operand only, not two operands)."""
    inputs, out = equation.split("->")
    specs = inputs.split(",")
    if len(specs) != 2 or any(len(set(s)) != len(s) for s in specs + [out]):
        return None
    a, b = specs
    if any(c not in out and c not in (b if c in a else a) for c in a + b):
        return None  # summed within one operand: einsum sums it first
    batch = [c for c in out if c in a and c in b]
    rows, cols = [c for c in out if c in a and c not in b], [c for c in out if c in b and c not in a]
    summed = [c for c in a if c in b and c not in out]
    best = None
    for swapped in (False, True):
        (lspec, lsz, lst), (rspec, rsz, rst) = ((b, sizes[1], strides[1]), (a, sizes[0], strides[0])) if swapped \
            else ((a, sizes[0], strides[0]), (b, sizes[1], strides[1]))
        lrows, rcols = (cols, rows) if swapped else (rows, cols)
        for m, n, k in itertools.product(_orders(lrows, lst, lspec), _orders(rcols, rst, rspec),
                                         _orders(summed, lst, lspec) + _orders(summed, rst, rspec)):
            left = _view(lsz, lst, lspec, ("".join(batch), m, k))
            right = _view(rsz, rst, rspec, ("".join(batch), k, n))
            result = "".join(batch) + m + n
            out_order = tuple(result.index(c) for c in out)
            out_sizes = left.groups[0] + left.groups[1] + right.groups[2]
            # elements copied: operands that no view gives, and the product when it must be permuted
            cost = left.copy * math.prod(lsz) + right.copy * math.prod(rsz) + \
                (out_order != tuple(range(len(out)))) * math.prod(out_sizes)
            if best is None or cost < best[0]:
                best = (cost, BmmPlan(left, right, swapped, out_sizes, out_order))
    return best[1]


_WORDS = (torch.int64, torch.int32, torch.int16)


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """t.contiguous(), its bytes moved as the widest integer words the layout allows. torch copies
    a permuted tensor one element per index computation: a bf16 head merge ((h, s, d) to (s, h, d),
    16 MB) ran at 1.4 TB/s on an H100, as int64 words at 2.6 (scripts/permuted_copy_probe.py)."""
    if t.is_contiguous() or t.dim() == 0 or t.stride(-1) != 1:
        return t.contiguous()
    for word in _WORDS:
        ratio = word.itemsize // t.element_size()
        if ratio <= 1:
            break
        if t.shape[-1] % ratio == 0 and t.storage_offset() % ratio == 0 and \
                all(s % ratio == 0 for n, s in zip(t.shape[:-1], t.stride()[:-1]) if n != 1):
            try:
                return t.view(word).contiguous().view(t.dtype)
            except RuntimeError:  # a size-1 dim's stride that torch's dtype view refuses
                break
    return t.contiguous()


def _matrices(t: torch.Tensor, view: OperandView) -> torch.Tensor:
    """`t` as the [batch, rows, cols] stack of `view`: strided where it lies, else copied with its
    fastest dim innermost."""
    b, r, c = (math.prod(g) for g in view.groups)
    if not view.copy:  # the plan is kept per operand layout: its strides are this tensor's
        return t.as_strided((b, r, c), view.strides, t.storage_offset())
    p = t.permute(view.order)
    if view.inner == "rows":  # [batch, cols, rows] contiguous, read transposed
        nb, nr = len(view.groups[0]), len(view.groups[1])
        dims = list(range(nb)) + list(range(nb + nr, p.dim())) + list(range(nb, nb + nr))
        return contiguous(p.permute(dims)).view(b, c, r).transpose(1, 2)
    return contiguous(p).view(b, r, c)


ALIGN_BYTES = 16  # cuBLAS takes its vectorised kernels only where the problem's dims are multiples of this
MIN_PADDED = 1 << 20  # elements of an output worth padding (a smaller GEMM is not bound by its stores)


def padded_right(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor | None:
    """`right` [batch, inner, cols] copied with its columns padded by zeros to a multiple of ALIGN_BYTES, where
    the product's columns would otherwise misalign cuBLAS: GPT-2's logits (50257 columns) ran through an
    align-1 CUTLASS kernel in 3.3 ms on an H100, an output with aligned rows alone did not change its choice,
    and the padded problem ran in 0.49 ms plus 0.09 for the copy (torch.compile pads too). The copy is made
    on every call, in the operand's own layout: a cached one would go stale inside a replayed CUDA graph."""
    (batch, rows, _), (_, inner, cols) = left.shape, right.shape
    step = ALIGN_BYTES // left.element_size()
    if left.dtype != right.dtype or cols % step == 0 or batch * rows * cols < MIN_PADDED:
        return None
    wide_cols = -(-cols // step) * step
    if right.stride(-2) == 1:  # a transposed weight: its columns are the runs that lie together
        wide = torch.empty(batch, wide_cols, inner, dtype=right.dtype, device=right.device).transpose(1, 2)
    else:
        wide = torch.empty(batch, inner, wide_cols, dtype=right.dtype, device=right.device)
    wide[..., :cols].copy_(right)
    wide[..., cols:].zero_()
    return wide


def row_padded(t: torch.Tensor) -> bool:
    """Rows of unit stride padded by less than ALIGN_BYTES (padded_right's products): kept as they are, since
    the program's kernels take strides and a copy would cost what the padding saved."""
    if t.dim() < 2 or t.stride(-1) != 1 or not 0 < t.stride(-2) - t.shape[-1] < ALIGN_BYTES // t.element_size():
        return False
    return t.as_strided(t.shape[:-1] + (t.stride(-2),), t.stride()).is_contiguous()


def run_bmm(plan: BmmPlan, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The contraction of `plan` over operands a and b (in the equation's order), as a view in
    the output's order (contiguous where the plan needs no output permutation; rows padded to
    ALIGN_BYTES where they would misalign cuBLAS's problem)."""
    left, right = (b, a) if plan.swapped else (a, b)
    left, right = _matrices(left, plan.left), _matrices(right, plan.right)
    wide = padded_right(left, right)
    out = torch.bmm(left, right) if wide is None else torch.bmm(left, wide)[..., :right.shape[-1]]
    try:
        return out.view(plan.out_sizes).permute(plan.out_order)
    except RuntimeError:  # a padded buffer whose columns the output splits across the padding
        return out.contiguous().view(plan.out_sizes).permute(plan.out_order)
