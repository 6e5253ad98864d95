"""Models as people write them, on CPU tensors under the Triton interpreter: GPT-2's MLP (Conv1D's flattened
rows around addmm, its GELU written out by hand) becomes one GEMM → GELU → GEMM chain (ir/reshapes.py,
ir/activations.py) and equals eager; with either rewrite off it stays apart and still equals eager."""

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest
import torch

import stitchflow
from stitchflow.targets.gpu.chain_match import dense_contraction

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter tests on CPU tensors (forcing the interpreter here would switch "
                                "a GPU session's other tests to it too)")

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


class Gpt2Mlp(torch.nn.Module):
    """transformers' GPT2MLP: Conv1D (addmm over the flattened rows) and NewGELUActivation."""

    def __init__(self, d: int, h: int, dtype: torch.dtype, residual: bool = True):
        super().__init__()
        self.residual = residual
        g = torch.Generator().manual_seed(d * h)
        self.w1 = torch.nn.Parameter((torch.randn(d, h, generator=g) / math.sqrt(d)).to(dtype))
        self.b1 = torch.nn.Parameter(torch.randn(h, generator=g).to(dtype))
        self.w2 = torch.nn.Parameter((torch.randn(h, d, generator=g) / math.sqrt(h)).to(dtype))
        self.b2 = torch.nn.Parameter(torch.randn(d, generator=g).to(dtype))

    def forward(self, x):
        lead = x.shape[:-1]
        h = torch.addmm(self.b1, x.reshape(-1, x.shape[-1]), self.w1).view(*lead, -1)
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        y = torch.addmm(self.b2, h.reshape(-1, h.shape[-1]), self.w2).view(*lead, -1)
        return y + x if self.residual else y


def chains_of(prog):
    """The GEMM → act → GEMM chains the program runs (a GEMM with its epilogue alone is not one)."""
    chains = [c for run in prog.compiled for c in getattr(run, "chains", ())]
    return [c for c in chains if sum(prog.graph.node_of[n].reduce == "sum" for n in c) == 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead,d,h,residual", [((2, 7), 24, 40, True), ((1, 13), 16, 33, True), ((3, 5), 8, 20, False)])
def test_gpt2_mlp_runs_as_one_chain(lead, d, h, residual, dtype):
    """With the residual add after it, and without (GPT2MLP alone: its flat output viewed back is the output, so
    its rows stay flat and the second GEMM reads the GELU's rows flattened)."""
    model = Gpt2Mlp(d, h, dtype, residual)
    x = torch.randn(*lead, d, generator=torch.Generator().manual_seed(3)).to(dtype)
    prog = stitchflow.compile(model, [x], target="gpu", fusion="auto")
    (chain,) = chains_of(prog)
    gelu = [n for n in prog.graph.nodes if n.tag is not None and n.tag.kind == "gelu"]
    assert len(gelu) == 1 and gelu[0].name in chain and "tanh" in str(gelu[0].body)
    with torch.no_grad():
        want = _double(model)(x.double())
    assert rel_err(prog(x), want) < TOL[dtype]
    assert "gelu_tanh" in prog.explain()


@pytest.mark.parametrize("option", ["unflatten_rows", "recognise_activations"])
def test_either_rewrite_off_leaves_no_chain_and_the_same_values(option):
    model = Gpt2Mlp(16, 24, torch.float32)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(4))
    prog = stitchflow.compile(model, [x], target="gpu", fusion="auto", options={option: False})
    assert chains_of(prog) == []
    with torch.no_grad():
        assert rel_err(prog(x), model(x)) < TOL[torch.float32]


def test_a_gemm_takes_its_rows_through_any_row_major_view():
    """Flattened rows and a batch of one are read in A's own order (free to reshape); merged heads, a slice and a
    transposed read are not."""
    def taken(fn, *args):
        graph = stitchflow.compile(fn, list(args)).graph
        gemm = next(n for n in graph.nodes if n.reduce == "sum")
        return dense_contraction(graph, gemm) is not None

    w = torch.randn(8, 5)
    assert taken(lambda x, w: x.reshape(-1, 8) @ w, torch.randn(3, 4, 8), w)
    assert taken(lambda x, w: x.reshape(-1, 8) @ w, torch.randn(1, 6, 8), w)
    assert not taken(lambda o, w: o.transpose(1, 2).reshape(-1, 8) @ w, torch.randn(2, 2, 5, 4), w)  # heads merged
    assert not taken(lambda x, w: x[:, 1:] @ w, torch.randn(4, 9), w)
    assert not taken(lambda x, w: x.t() @ w, torch.randn(8, 6), w)
    assert not taken(lambda x, w: x.transpose(0, 1).reshape(-1, 8) @ w, torch.randn(4, 3, 8), w)


def _double(model: Gpt2Mlp) -> Gpt2Mlp:
    twin = Gpt2Mlp(model.w1.shape[0], model.w1.shape[1], torch.float64, model.residual)
    twin.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    return twin


@pytest.mark.parametrize("name,act", [("hf-gpt2", "gelu"), ("hf-opt", "relu")])
def test_hugging_face_mlps_run_as_chains_through_the_backend(name, act, fresh_dynamo):
    """transformers' GPT-2 (Conv1D, NewGELU) and OPT (rows flattened by the decoder layer, ReLU) under
    torch.compile(backend="stitchflow") on the gpu target: every layer's MLP one chain, equal to eager."""
    pytest.importorskip("transformers")
    import stitchflow.backend as backend
    from stitchflow.apps import build_model

    model, (ids,) = build_model(name, "small")
    with torch.no_grad():
        want = model(ids)
        got = torch.compile(model, backend="stitchflow", options={"target": "gpu"})(ids)
    assert rel_err(got, want) < TOL[torch.float32]
    assert backend.FALLBACKS == [], backend.fallback_report()
    programs = [p for m in backend.COMPILED for p in m.programs.values() if p is not None]
    chains = [c for p in programs for c in chains_of(p)]
    assert len(chains) == 2  # the small models have two layers
    for prog in programs:
        for chain in chains_of(prog):
            nodes = [prog.graph.node_of[n] for n in chain]
            assert any(act in str(n.body) or (n.tag is not None and n.tag.kind == act) for n in nodes)


@pytest.mark.parametrize("name,size", [("hf-gpt2", "small"), ("hf-llama", "small-padded")])
def test_hugging_face_models_through_stitchflow_compile(name, size):
    """stitchflow.compile exports the models (their key/value-cache constant detached in place) and the gpu target
    runs them: GPT-2's MLPs as chains here too, equal to eager on fresh inputs."""
    pytest.importorskip("transformers")
    from stitchflow.apps import build_model

    model, inputs = build_model(name, size)
    prog = stitchflow.compile(model, inputs, target="gpu", fusion="auto")
    _, fresh = build_model(name, size, seed=3)
    with torch.no_grad():
        assert rel_err(prog(*fresh), model(*fresh)) < TOL[torch.float32]
    if name == "hf-gpt2":
        assert len(chains_of(prog)) == 2


@pytest.mark.parametrize("name", ["hf-gpt2", "hf-opt"])
def test_hugging_face_training_steps_get_eagers_gradients(name, fresh_dynamo):
    """The rewrites run on AOTAutograd's forward and backward graphs too (every linear layer there is a GEMM over
    flattened rows): a training step's gradients equal eager's."""
    pytest.importorskip("transformers")
    import copy

    import stitchflow.backend as backend
    from stitchflow.apps import build_model

    model, (ids,) = build_model(name, "small")
    model.train()
    reference = copy.deepcopy(model)
    (reference(ids) ** 2).mean().backward()
    (torch.compile(model, backend="stitchflow", options={"target": "gpu"})(ids) ** 2).mean().backward()
    assert backend.FALLBACKS == [], backend.fallback_report()
    for (path, p), q in zip(model.named_parameters(), reference.parameters()):
        # a key projection's bias gets a zero gradient (softmax ignores a shift per query) up to rounding
        atol = 1e-4 * max(1.0, q.grad.abs().max().item())
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=atol, msg=lambda m: f"{path}: {m}")


def test_the_rewrites_say_what_they_did(caplog):
    model = Gpt2Mlp(16, 24, torch.float32)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(4))
    with caplog.at_level("INFO", logger="stitchflow.gpu"):
        prog = stitchflow.compile(model, [x], target="gpu", fusion="auto")
    assert "rows unflattened" in caplog.text and "recognised: mul_3 (gelu)" in caplog.text
    explained = prog.explain()
    assert "graph rewrites:" in explained and "recognised: mul_3 (gelu)" in explained
