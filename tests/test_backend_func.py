"""torch.func transforms under torch.compile(backend="stitchflow"): Dynamo inlines grad, vjp, jacrev, jacfwd, hessian,
jvp and vmap as functorch's runtime calls, which have no storage to capture a program on. The backend hands such
graphs to AOTAutograd, whose tracing runs the transforms and leaves plain ATen ops (batched, differentiated); those
compile like any other graph. Each result equals eager's, with nothing left to eager."""

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import stitchflow.backend as backend
from conftest import assert_close

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

W = torch.randn(6, 6, generator=torch.Generator().manual_seed(0))


def _mapped(x):
    return (x @ W).sin()


def _scalar(x):
    return (x @ W).tanh().sum()


def _inputs(*shapes):
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(*s, generator=g) for s in shapes)


CASES = {
    "jacrev": (jacrev(_mapped), lambda: _inputs((6,))),
    "jacfwd": (jacfwd(_mapped), lambda: _inputs((6,))),
    "hessian": (hessian(_scalar), lambda: _inputs((6,))),
    "jvp": (lambda x, t: jvp(_mapped, (x,), (t,)), lambda: _inputs((6,), (6,))),
    "vjp": (lambda x, t: vjp(_mapped, x)[1](t), lambda: _inputs((6,), (6,))),
    "batched_jacobians": (vmap(jacrev(_mapped)), lambda: _inputs((3, 6))),
    "vmap_gather": (vmap(lambda x, i: x.gather(0, i).exp()),
                    lambda: (*_inputs((4, 5)), torch.randint(0, 5, (4, 3), generator=torch.Generator().manual_seed(2)))),
}


def _flat(out) -> torch.Tensor:
    return torch.cat([t.flatten() for t in (out if isinstance(out, (tuple, list)) else (out,))])


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_transform_compiles_whole(name):
    fn, make = CASES[name]
    args = make()
    assert_close(_flat(torch.compile(fn, backend="stitchflow")(*args)), _flat(fn(*args)))
    assert backend.FALLBACKS == [], backend.fallback_report()
    assert backend.regions_executed() >= 1


def test_per_sample_gradients_of_a_model():
    """The torch.func recipe: vmap over the batch of grad of the loss of one sample, through functional_call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x, y):
        return nn.functional.cross_entropy(functional_call(model, p, (x.unsqueeze(0),)), y.unsqueeze(0))

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    expected, got = per_sample(params, x, y), torch.compile(per_sample, backend="stitchflow")(params, x, y)
    for name in expected:
        assert_close(got[name], expected[name])
    assert backend.FALLBACKS == [], backend.fallback_report()


def test_a_physics_informed_loss_trains_through_second_derivatives():
    """A PINN's residual: u'' + u' - sin(x) at collocation points, the derivatives by vmap(grad(...)) of the
    network in x, then the loss's gradient in the parameters (AOTAutograd's training graphs hold it all)."""
    import copy

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    twin = copy.deepcopy(net)

    def residual(model, x):
        u = lambda t: model(t.reshape(1, 1)).sum()  # noqa: E731
        return (vmap(grad(grad(u)))(x) + vmap(grad(u))(x) - x.sin()).square().mean()

    x = torch.linspace(0, 1, 16)
    got = torch.compile(lambda x: residual(net, x), backend="stitchflow")(x)
    want = residual(twin, x)
    got.backward()
    want.backward()
    assert_close(got, want)
    for p, q in zip(net.parameters(), twin.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    assert backend.FALLBACKS == [], backend.fallback_report()
