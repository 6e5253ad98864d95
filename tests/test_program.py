"""The public API end to end: stitchflow.compile on the app zoo, sparse formats, fusion
configurations, explanations and the errors bad input gets."""

import pytest
import torch
import torch.nn as nn

import stitchflow
from conftest import assert_close
from stitchflow.apps import APPS, GCN, load_dataset
from stitchflow.ir.types import Level


@pytest.fixture(scope="module")
def cora():
    data = load_dataset("cora")
    return data, GCN(in_features=data.x.shape[1]).eval()


@pytest.mark.parametrize("app", sorted(APPS))
@pytest.mark.parametrize("fusion", ["unfused", "partial", "full", "auto"])
def test_every_app_equals_eager(app, fusion):
    model, inputs = APPS[app].build(size="small")
    prog = stitchflow.compile(model, inputs, fusion=fusion)
    assert_close(prog(*inputs), model(*inputs))
    assert prog.regions_executed == len(prog.regions) > 0


def test_gcn_on_cora_csr_and_dcsr(cora):
    data, gcn = cora
    a, x = data.adjacency("csr"), data.x
    prog = stitchflow.compile(gcn, (a, x))
    assert_close(prog(a, x), gcn(a, x))
    adj = prog.graph.inputs[0]
    assert prog.graph.type_of[adj].format.levels == (Level.DENSE, Level.COMPRESSED)
    assert "csr" in str(prog.graph)
    dcsr = stitchflow.compile(gcn, (a, x), formats={0: "dcsr"})
    assert dcsr.graph.type_of[adj].format.levels == (Level.COMPRESSED, Level.COMPRESSED)
    assert_close(dcsr(a, x), gcn(a, x))
    assert dcsr.graph.type_of["layer1_weight"].format.levels == (Level.COMPRESSED, Level.COMPRESSED)


def test_coo_and_bsr_inputs(cora):
    data, gcn = cora
    x = data.x
    coo = data.adjacency("coo")
    assert_close(stitchflow.compile(gcn, (coo, x))(coo, x), gcn(coo, x))
    dense = data.adjacency("dense")[:2704, :2704]
    bsr = dense.to_sparse_bsr((16, 16))
    fn = lambda s, d: torch.relu(s @ d)  # noqa: E731
    prog = stitchflow.compile(fn, (bsr, x[:2704]))
    assert prog.graph.type_of[prog.graph.inputs[0]].format.block == (16, 16)
    assert_close(prog(bsr, x[:2704]), fn(bsr, x[:2704]))


def test_fusion_configurations_of_gcn():
    model, inputs = APPS["gcn"].build(size="small")
    counts = {f: len(stitchflow.compile(model, inputs, fusion=f).regions) for f in ("unfused", "partial", "full")}
    assert counts == {"unfused": 8, "partial": 2, "full": 1}  # FuseFlow's 8 kernels; one region per layer
    explicit = stitchflow.compile(model, inputs, fusion=[["layer1"], ["layer2"]])
    assert len(explicit.regions) == 2


def test_explain_gives_a_reason_for_every_pair():
    model, inputs = APPS["gcn"].build(size="small")
    for fusion in ("unfused", "partial", "auto"):
        report = stitchflow.compile(model, inputs, fusion=fusion).explain()
        pairs = [line for line in report.splitlines() if " -> " in line and ": " in line]
        assert pairs and all(line.rsplit(": ", 1)[1].strip() for line in pairs)
        assert "not fused" in report or fusion != "unfused"


def test_unsupported_op_is_named():
    with pytest.raises(stitchflow.UnsupportedOpError, match="i0"):
        stitchflow.compile(lambda x: torch.i0(x), (torch.randn(3),))


def test_unknown_format_is_named():
    a = torch.eye(3).to_sparse_csr()
    with pytest.raises(stitchflow.FormatError, match="'sparse-ish'"):
        stitchflow.compile(lambda s, d: s @ d, (a, torch.randn(3, 2)), formats={0: "sparse-ish"})


def test_shape_mismatch_at_compile_and_call():
    with pytest.raises(stitchflow.StitchflowError):
        stitchflow.compile(lambda a, b: a @ b, (torch.randn(3, 4), torch.randn(5, 2)))
    prog = stitchflow.compile(lambda a: a * 2, (torch.randn(3, 4),))
    with pytest.raises(stitchflow.ShapeError, match=r"expected float32\[3,4\]"):
        prog(torch.randn(4, 4))


def test_bad_region_lists_are_refused():
    model, inputs = APPS["gcn"].build(size="small")
    with pytest.raises(stitchflow.StitchflowError, match="names no node"):
        stitchflow.compile(model, inputs, fusion=[["no_such_layer"]])
    with pytest.raises(stitchflow.StitchflowError, match="unknown fusion"):
        stitchflow.compile(model, inputs, fusion="everything")


def test_cuda_graphs_option_is_checked():
    """True, False and "always" (keep the replay without timing it against a plain call) are accepted;
    anything else is refused with the values it may take."""
    fn = lambda x: x * 2  # noqa: E731
    for value in (True, False, "always"):
        assert_close(stitchflow.compile(fn, (torch.randn(3),), options={"cuda_graphs": value})(torch.ones(3)),
                     torch.full((3,), 2.0))
    with pytest.raises(stitchflow.StitchflowError, match="'always'"):
        stitchflow.compile(fn, (torch.randn(3),), options={"cuda_graphs": "sometimes"})


class Untraceable(nn.Module):
    """Python control flow on a shape: FX symbolic tracing fails, torch.export does not."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        for _ in range(x.shape[0] // 2):
            x = torch.tanh(self.lin(x))
        return x


def test_export_fallback_captures_aten_graphs():
    model, x = Untraceable().eval(), torch.randn(4, 6)
    prog = stitchflow.compile(model, (x,))
    assert_close(prog(x), model(x))
    assert sum(n.tag is not None and n.tag.kind == "linear" for n in prog.graph.nodes) >= 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("rows", [8, 8192])
def test_cuda_graph_replay_is_timed_kept_or_declined_and_stays_correct(rows):
    """A gpu program decides on its third call whether a CUDA-graph replay beats a plain call
    (the replay copies inputs in and outputs out); either way every call equals eager."""
    fn = lambda x, b: torch.nn.functional.gelu(x + b) * 2.0  # noqa: E731
    make = lambda: (torch.randn(rows, 1024, device="cuda"), torch.randn(1024, device="cuda"))  # noqa: E731
    prog = stitchflow.compile(fn, make(), target="gpu")
    for _ in range(6):
        args = make()
        torch.testing.assert_close(prog(*args), fn(*args), rtol=1e-5, atol=1e-5)
    replay = prog._replay
    assert replay.graph is not None or replay.failed.startswith("not worth a graph")


def test_programs_differentiate_the_reference_where_autograd_records():
    """stitchflow.compile's programs run forward as compiled; where autograd records (inputs or the model's
    parameters require grad), the backward recomputes the model eagerly: eager's gradients."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    x = torch.randn(5, 8)
    prog = stitchflow.compile(model, [x], fusion="full")
    xs = (x.clone().requires_grad_(), x.clone().requires_grad_())
    out, ref = prog(xs[0]), reference(xs[1])
    assert out.requires_grad and prog.regions_executed == len(prog.regions)
    (out * torch.arange(4.0)).sum().backward()
    (ref * torch.arange(4.0)).sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    with torch.no_grad():
        assert not prog(x).requires_grad

    def fn(a, b):  # a function: gradients for the inputs that need them; several outputs, one not a tensor
        return torch.relu(a) * b, a.sum(), 3

    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    first, second, third = stitchflow.compile(fn, [a.detach(), b])(a, b)
    assert third == 3
    (first.sum() + second).backward()
    torch.testing.assert_close(a.grad, (a > 0).float() * b + 1)


class _Box:
    def __init__(self, t):
        self.t = t


class _ReturnsABox(torch.nn.Module):
    def forward(self, x):
        if x.shape[0] > 2:  # a branch on a shape: symbolic tracing fails, torch.export takes over
            return _Box(x * 2)
        return _Box(x)


def test_an_output_torch_export_cannot_flatten_is_named():
    with pytest.raises(stitchflow.StitchflowError, match="cannot flatten what the model returns.*_Box"):
        stitchflow.compile(_ReturnsABox(), (torch.ones(3),))


class _Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x, gate=None, scale_up=False):
        y = self.proj(x) * torch.sigmoid(gate)
        return y * 2 if scale_up else y


def test_keyword_inputs_compile_and_the_program_is_called_as_the_model_is():
    torch.manual_seed(0)
    model, x, gate = _Gated(), torch.randn(3, 6), torch.randn(3, 6)
    prog = stitchflow.compile(model, (x,), example_kwargs={"gate": gate, "scale_up": True}, fusion="full")
    x2, gate2 = torch.randn(3, 6), torch.randn(3, 6)
    with torch.no_grad():
        assert_close(prog(x2, scale_up=True, gate=gate2), model(x2, gate=gate2, scale_up=True))
    with pytest.raises(stitchflow.StitchflowError, match="compiled for scale_up=True, called with False"):
        prog(x2, gate=gate2, scale_up=False)
    with pytest.raises(stitchflow.StitchflowError, match="1 positional inputs and the keywords gate, scale_up; called "
                                                         "with 2 and none"):
        prog(x2, gate2)
    plain = stitchflow.compile(model, (x, gate))
    with pytest.raises(stitchflow.StitchflowError, match="positional inputs only, called with keywords gate"):
        plain(x2, gate=gate2)


def test_keyword_inputs_get_eagers_gradients():
    """Where autograd records, the program's backward runs the model again with the same keywords."""
    torch.manual_seed(0)
    model, x, gate = _Gated(), torch.randn(3, 6), torch.randn(3, 6, requires_grad=True)
    prog = stitchflow.compile(model, (x,), example_kwargs={"gate": gate, "scale_up": False})
    prog(x, gate=gate, scale_up=False).square().sum().backward()
    got = [gate.grad.clone(), *(p.grad.clone() for p in model.parameters())]
    gate.grad = None
    model.zero_grad()
    model(x, gate=gate).square().sum().backward()
    for g, w in zip(got, [gate.grad, *(p.grad for p in model.parameters())]):
        assert_close(g, w)


def test_a_function_with_keyword_inputs_compiles():
    def f(x, *, bias, twice=False):
        return torch.relu(x + bias) * (2 if twice else 1)

    x, bias = torch.randn(4, 5), torch.randn(5)
    prog = stitchflow.compile(f, (x,), example_kwargs={"bias": bias, "twice": True})
    x2 = torch.randn(4, 5)
    assert_close(prog(x2, bias=bias, twice=True), f(x2, bias=bias, twice=True))
