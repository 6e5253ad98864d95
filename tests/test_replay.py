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
    assert producer._replay.graph is not None and producer._replay.handed_over
    assert producer._replay.plain_calls >= 4  # the held outputs sent those calls around the graph


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
    moved = f(torch.randn(256, 512, device="cuda"))  # not the producer's buffer: the consumer must not replay on it
    calls = consumer._replay.plain_calls
    torch.testing.assert_close(consumer(moved), g(moved), rtol=1e-4, atol=1e-3)
    assert consumer._replay.plain_calls == calls + 1
