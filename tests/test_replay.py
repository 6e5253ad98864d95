"""CUDA-graph replays that hand their outputs over without clones and read other graphs' outputs
where they lie: a held output is never overwritten, a moved input is never missed."""

import pytest
import torch

import stitchflow
from stitchflow.replay import storage_uses

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def test_storage_uses_count_the_tensors_that_hold_a_storage():
    """What a replay asks before it overwrites a handed-over output: a detached tensor and a view
    each hold the storage, a second name for the same tensor does not."""
    t = torch.randn(4, 5)
    alone = storage_uses(t)
    handed, view = t.detach(), t.permute(1, 0)
    same = t
    assert storage_uses(t) == alone + 2 and same is t
    del handed, view
    assert storage_uses(t) == alone


def _programs():
    f = lambda x: torch.nn.functional.gelu(x * 2.0) + 1.0  # noqa: E731
    g = lambda y: (y * y).sum(-1)  # noqa: E731
    x = torch.randn(256, 512, device="cuda")
    names = stitchflow.compile(f, (x,), target="gpu").graph.outputs
    producer = stitchflow.compile(f, (x,), target="gpu", options={"cuda_graphs": "always", "free_outputs": names})
    consumer = stitchflow.compile(g, (f(x),), target="gpu", options={"cuda_graphs": "always"})
    return f, g, producer, consumer


@cuda
def test_a_held_output_is_never_overwritten():
    f, _, producer, _ = _programs()
    xs = [torch.randn(256, 512, device="cuda") for _ in range(8)]
    held = [producer(x) for x in xs]  # every output still held when the next call comes
    for x, y in zip(xs, held):
        torch.testing.assert_close(y, f(x))
    replay = producer._replay
    assert replay.graph is not None and replay.handed_over
    assert len(replay.slots) == 2  # a second set of buffers while the first's outputs were held
    assert replay.plain_calls >= 3  # then both sets held: those calls went around the graphs


@cuda
def test_a_borrowed_input_is_read_where_it_lies_and_only_there():
    f, g, producer, consumer = _programs()
    for step in range(8):
        x = torch.randn(256, 512, device="cuda")
        y = producer(x)
        torch.testing.assert_close(consumer(y), g(f(x)), rtol=1e-4, atol=1e-3)
        del y  # free again before the producer's next call, as a training step frees its saved activations
    assert consumer._replay.borrowed, "the consumer copied the producer's output in"
    assert producer._replay.plain_calls == 0
    for _ in range(2):  # not the producer's buffer: the consumer must not read its graph's address
        moved = f(torch.randn(256, 512, device="cuda"))
        torch.testing.assert_close(consumer(moved), g(moved), rtol=1e-4, atol=1e-3)
    first, second = consumer._replay.slots
    assert first.borrowed and not second.borrowed  # a second graph that copies its input in


@cuda
def test_a_cnns_whole_training_step_replays_and_stays_eagers(fp32_convolutions):
    """AOTAutograd's forward and backward graphs, eager convolution backwards among them, replay as one
    CUDA graph each from the third step on, the forward handing its saved activations over; every step's
    loss, input gradient and parameters equal eager's."""
    import copy

    import torch.nn as nn

    from stitchflow import backend
    from stitchflow.replay import AOT_REPLAYS

    torch._dynamo.reset()
    backend.reset()
    earlier = set(AOT_REPLAYS)  # other tests' replays may still be alive
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                          nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(16, 5)).cuda()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="stitchflow", options={"cuda_graphs": "always"})  # whatever the timing
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, reference)]
    for step in range(8):
        x = torch.randn(8, 3, 20, 20, device="cuda")
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        losses = [f(v).square().mean() for f, v in zip((compiled, reference), xs)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-3, atol=1e-5)
        for opt in opts:
            opt.step(), opt.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-5)
    for a, b in zip(model.buffers(), reference.buffers()):  # running statistics, updated once a step
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    replays = [r.replay for r in set(AOT_REPLAYS) - earlier if r.replay.calls]
    assert len(replays) >= 2 and all(r.graph is not None for r in replays), [r.failed for r in replays]
    assert any(r.handed_over for r in replays) and any(r.borrowed for r in replays)
    # the forward's graph writes the running statistics into the buffers itself (AOTAutograd's copies
    # back become no-ops): 2 batch norms x (mean, variance, count)
    assert any(len(slot.written_back) == 6 for r in replays for slot in r.slots), \
        [[slot.written_back for slot in r.slots] for r in replays]
    # the last step's loss (and the backward's graph it holds) lives into the next forward: the
    # replays take turns on two sets of buffers instead of falling back to plain calls
    assert all(r.plain_calls == 0 for r in replays), [(len(r.slots), r.plain_calls) for r in replays]


def test_a_programs_replayer_defers_to_a_whole_graphs():
    """Inside a whole AOTAutograd graph's replayer, a program's own replayer neither counts calls nor
    captures: the outer graph records its kernels, and graphs of its own would hold a third buffer set."""
    from stitchflow.replay import _UNDER_OUTER_REPLAY, GraphReplay

    calls = []
    inner = GraphReplay(lambda inputs: calls.append(1) or {"y": inputs[0] * 2}, ["y"])
    token = _UNDER_OUTER_REPLAY.set(True)
    try:
        for _ in range(5):
            assert torch.equal(inner([torch.ones(3)])["y"], torch.full((3,), 2.0))
    finally:
        _UNDER_OUTER_REPLAY.reset(token)
    assert len(calls) == 5 and inner.calls == 0 and not inner.slots


@cuda
def test_a_backwards_gradients_are_handed_over_and_never_overwritten_while_held():
    """The backward's graph hands its gradients to autograd without clones and reads the forward's
    transposed weights where they lie. Gradients accumulated over steps, and gradients a caller keeps
    after clearing .grad, stay what eager computes while later steps replay."""
    import copy

    import torch.nn as nn

    from stitchflow import backend
    from stitchflow.replay import AOT_REPLAYS

    torch._dynamo.reset()
    backend.reset()
    earlier = set(AOT_REPLAYS)  # other tests' replays may still be alive
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 8)).cuda()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="stitchflow", options={"cuda_graphs": "always"})
    kept, kept_values = [], []
    for step in range(8):
        x = torch.randn(32, 64, device="cuda")
        for f in (compiled, reference):
            f(x).square().sum().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)
        if step >= 3:  # from here on: keep the gradients, clear .grad (steps 0-3 accumulate)
            kept += [p.grad for p in model.parameters()]
            kept_values += [p.grad.clone() for p in model.parameters()]
            for m in (model, reference):
                m.zero_grad()
    for held, value in zip(kept, kept_values):
        assert torch.equal(held, value)  # no replay wrote into a gradient someone holds
    backward = [r.replay for r in set(AOT_REPLAYS) - earlier
                if r.replay.calls and r.replay.free == set(r.replay.outputs)]
    assert len(backward) == 1 and backward[0].graph is not None, [r.replay.failed for r in AOT_REPLAYS]
    replay = backward[0]
    assert replay.handed_over, "the gradients were cloned out of the graph"
    first = replay.slots[0]
    copied = [s for s in first.static_inputs if s is not None]
    assert first.borrowed
    assert not any(s.shape in {(64, 96), (96, 64), (96, 8), (8, 96)} for s in copied), \
        "a (transposed) weight was copied into the backward's graph"
