"""Grouped GEMMs on the gpu target: the contractions of ops_grouped's products are recognised (every form, the
operands read through gathers and transposes as a mixture of experts hands them over), run as one grouped GEMM step
rather than an einsum over a gathered copy of the weights, and equal the per-group loop. The helpers' loop path is
checked against the definition, with empty groups."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import stitchflow  # noqa: E402
from stitchflow.targets.gpu import contraction  # noqa: E402
from stitchflow.targets.gpu.grouped_gemm import grouped_reduction, grouped_rows  # noqa: E402
from stitchflow.targets.gpu.grouping import TorchStep  # noqa: E402
from conftest import assert_close  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _steps(prog):
    return [s for run in prog._compiled for s in run.steps if isinstance(s, TorchStep)]


def moe_experts(hidden, experts, weights, gate_up, down):
    """transformers' grouped experts, shortened: tokens sorted by expert, gathered, two grouped products."""
    ids, perm = torch.sort(experts.reshape(-1))
    rows = hidden[perm // experts.shape[-1]]
    counts = torch.histc(ids.float(), bins=gate_up.shape[0], min=0, max=gate_up.shape[0] - 1)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    gate, up = torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    out = torch._grouped_mm(torch.nn.functional.silu(gate) * up, down.transpose(-2, -1), offs=offs)
    out = out * weights.reshape(-1)[perm, None]
    return torch.zeros_like(hidden).index_add_(0, perm // experts.shape[-1], out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mixture_of_experts_runs_grouped_gemms_without_gathering_weights(dtype, monkeypatch):
    g = torch.Generator().manual_seed(0)
    tokens, hidden, inner, experts, top = 13, 16, 24, 4, 2
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    chosen = torch.stack([torch.randperm(experts, generator=g)[:top] for _ in range(tokens)])
    weights = torch.rand(tokens, top, generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * inner, hidden, generator=g) / 4).to(dtype)
    down = (torch.randn(experts, hidden, inner, generator=g) / 4).to(dtype)
    args = tuple(t.to(DEVICE) for t in (x, chosen, weights, gate_up, down))
    prog = stitchflow.compile(moe_experts, args, target="gpu", fusion="auto")
    grouped = [s for s in _steps(prog) if s.grouped is not None]
    assert len(grouped) == 2 and all("grouped GEMM, 4 groups" in str(s) for s in grouped)

    def gathered(access, *rest):  # the tokens' rows may be gathered, an expert's weights never
        assert access.tensor not in ("gate_up", "down"), "expert weights gathered per row"
        return real(access, *rest)

    real = contraction._gather_index
    monkeypatch.setattr(contraction, "_gather_index", gathered)
    assert_close(prog(*args).cpu(), moe_experts(*(t.cpu() for t in args)))


@pytest.mark.parametrize("form", ["rows", "columns", "jagged"])
def test_each_form_is_one_grouped_step(form):
    """(K = 16: sums of at most 8 terms are unrolled into generated kernels, rewrites.unroll_small_sums.)"""
    a = {"rows": torch.randn(12, 16), "columns": torch.randn(3, 8, 16), "jagged": torch.randn(12, 16).t()}[form]
    b = {"rows": torch.randn(3, 16, 8), "columns": torch.randn(12, 16).t(), "jagged": torch.randn(12, 8)}[form]
    offs = torch.tensor([5, 5, 12], dtype=torch.int32)
    prog = stitchflow.compile(lambda a, b, o: torch._grouped_mm(a, b, offs=o), (a, b, offs), target="gpu",
                              fusion="auto")
    assert_close(prog(a, b, offs), torch._grouped_mm(a, b, offs=offs))
    (step,) = [s for s in _steps(prog) if s.grouped is not None]
    assert step.grouped.kind == ("jagged" if form == "jagged" else "gathered")
    assert step.grouped.count == 3
    assert f"{step.node.name}: 3 groups" in prog.explain()


def test_helpers_loop_over_groups_empty_ones_included():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 5, generator=g), torch.randn(3, 5, 4, generator=g)
    ends = torch.tensor([2, 2, 9])
    out = grouped_rows(x, w, ends, torch.float32)
    assert_close(out, torch.cat([x[:2] @ w[0], x[2:] @ w[2]]))
    a, b = torch.randn(6, 9, generator=g), torch.randn(9, 4, generator=g)
    out = grouped_reduction(a, b, torch.tensor([0, 4, 7]), torch.float32)
    assert_close(out, torch.stack([torch.zeros(6, 4), a[:, :4] @ b[:4], a[:, 4:7] @ b[4:7]]))


def test_a_layout_the_library_refuses_runs_the_loop(monkeypatch):
    """torch._grouped_mm's layout rules are its kernels': a refusal costs speed, not the call."""
    from stitchflow.targets.gpu import grouped_gemm

    def refuse(*args, **kwargs):
        raise RuntimeError("strides should be multiple of 16 bytes")

    monkeypatch.setattr(grouped_gemm, "_library_grouped", lambda *args: True)
    monkeypatch.setattr(torch, "_grouped_mm", refuse)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(7, 5, generator=g), torch.randn(2, 5, 3, generator=g)
    out = grouped_rows(x, w, torch.tensor([3, 7]), torch.float32)
    assert_close(out, torch.cat([x[:3] @ w[0], x[3:] @ w[1]]))
