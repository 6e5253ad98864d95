"""Inputs a partition writes in place through torch.compile(backend="stitchflow"): a cache's copy_, x += v, item
assignment, a module's buffer updated during a training step. The program computes the written value with the rest
and copies it into the caller's tensor after the call; the caller's tensors equal eager's after every call, and
nothing falls back. An input that requires grad is not written by a program (autograd would not see it): the
partition splits around the write, which runs eagerly."""

import pytest
import torch

import stitchflow
import stitchflow.backend as backend
from conftest import assert_close, twins


def cache_copy(cache, x):
    cache.copy_(x * 2)
    return cache + 1


def state_update(state, x):
    state[:, 1] = x.sum(-1)
    state += 1
    return (state * x[:, :1]).relu()


def position_counter(count, x):
    """transformers' static cache: its length moved to the device (`.to` returns the tensor itself), positions
    counted from it, then the length advanced in place through the moved name."""
    count = count.to(x.device)
    positions = torch.arange(x.shape[0]) + count
    count.add_(x.shape[0])
    return x * positions[:, None]


CASES = {
    "copy_": (cache_copy, lambda g: (torch.zeros(4), torch.randn(4, generator=g))),
    "add_through_to": (position_counter, lambda g: (torch.tensor(0), torch.randn(3, 2, generator=g))),
    "setitem_and_iadd": (state_update, lambda g: (torch.zeros(3, 4), torch.randn(3, 5, generator=g))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_written_inputs_end_as_in_eager(name, fresh_dynamo):
    fn, make = CASES[name]
    g = torch.Generator().manual_seed(0)
    ours = make(g)
    theirs = tuple(t.clone() for t in ours)
    compiled = torch.compile(fn, backend="stitchflow")
    for _ in range(3):  # the written value feeds the next call
        assert_close(compiled(*ours), fn(*theirs))
        assert_close(ours[0], theirs[0])
    assert not backend.FALLBACKS, backend.fallback_report()
    assert sum(m.regions_executed for m in backend.COMPILED) >= 1


class Counting(torch.nn.Module):
    """A layer that keeps statistics of its activations in a buffer, written during the forward."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x):
        y = (x @ self.w).tanh()
        self.seen.add_(y.detach().sum(0))
        return (y * self.seen).sum()


def test_a_buffer_written_during_a_training_step(fresh_dynamo):
    """The recomputed backward starts from the buffer as it came, not as the program left it."""
    ours, theirs = twins(Counting)
    compiled = torch.compile(ours, backend="stitchflow", options={"training": "recompute"})
    x = torch.randn(3, 4)
    for _ in range(2):
        compiled(x).backward()
        theirs(x).backward()
        assert_close(ours.seen, theirs.seen)
        assert_close(ours.w.grad, theirs.w.grad)
    assert not backend.FALLBACKS, backend.fallback_report()


def test_a_written_input_that_requires_grad_runs_its_write_eagerly(fresh_dynamo):
    """(AOTAutograd, the default training mode, functionalizes the write before the backend sees it; the recompute
    mode hands the backend Dynamo's graph, write and all.)"""
    def f(z, y):
        z.add_(y)  # an activation written in place: autograd records the write
        return (z.sin() * y).sum()

    a, y = torch.randn(5, requires_grad=True), torch.randn(5)
    ours, theirs = a.detach().clone().requires_grad_(), a.detach().clone().requires_grad_()
    z_ours, z_theirs = ours * 1, theirs * 1
    torch.compile(f, backend="stitchflow", options={"training": "recompute"})(z_ours, y).backward()
    f(z_theirs, y).backward()
    assert_close(z_ours, z_theirs)
    assert_close(ours.grad, theirs.grad)
    assert any("add_" in reason and "mutates an input" in reason for reason in backend.FALLBACKS)


def test_a_program_copies_written_inputs_back_through_stitchflow_compile():
    g = torch.Generator().manual_seed(1)
    cache, x = CASES["copy_"][1](g)
    prog = stitchflow.compile(cache_copy, (cache.clone(), x))
    mine, ref = cache.clone(), cache.clone()
    assert_close(prog(mine, x), cache_copy(ref, x))
    assert_close(mine, ref)
