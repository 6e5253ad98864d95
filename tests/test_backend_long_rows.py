"""Rows past QUADRATIC_SORT and QUADRATIC_SCAN through torch.compile(backend="stitchflow"): generation's logits
processors (Hugging Face's temperature, repetition penalty, top-k, top-p and min-p: top-p sorts the whole vocabulary,
merge-ranked, takes a cumulative sum of its probabilities, scanned in blocks, and scatters the mask back), each
whole and equal to eager exactly; and a training step through long sorts and scans."""

import pytest
import torch

from stitchflow import backend
from stitchflow.frontend import ops_scan, ops_sort
from conftest import twins

VOCAB = 3000
assert VOCAB > max(ops_sort.QUADRATIC_SORT, ops_scan.QUADRATIC_SCAN)


def _chain(processors):
    return [processors.TemperatureLogitsWarper(0.7), processors.RepetitionPenaltyLogitsProcessor(1.2),
            processors.TopKLogitsWarper(50), processors.TopPLogitsWarper(0.9), processors.MinPLogitsWarper(0.05)]


def _process(chain, ids, scores):
    for p in chain:
        scores = p(ids, scores)
    return scores


@pytest.mark.parametrize("which", ["top_p", "whole_chain"])
def test_sampling_processors_compile_whole(which, fresh_dynamo):
    processors = pytest.importorskip("transformers.generation.logits_process")
    g = torch.Generator().manual_seed(0)
    scores, ids = torch.randn(2, VOCAB, generator=g), torch.randint(0, VOCAB, (2, 7), generator=g)
    chain = _chain(processors) if which == "whole_chain" else [processors.TopPLogitsWarper(0.8)]
    compiled = torch.compile(lambda i, s: _process(chain, i, s), backend="stitchflow")
    assert torch.equal(compiled(ids, scores), _process(chain, ids, scores))
    assert not backend.FALLBACKS, backend.fallback_report()
    assert backend.COMPILED


class LongRows(torch.nn.Module):
    """Scans and sorts along rows of 3000: their backward graphs (a reversed cumsum, scatters through the sort's and
    the running maximum's indices) compile too."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, VOCAB)

    def forward(self, x):
        h = self.proj(x)
        ranked = torch.sort(h, -1, descending=True).values[..., :10] * torch.arange(10.0)
        return (torch.cumsum(h.softmax(-1), -1).mean() + torch.topk(h, 5, dim=-1).values.sum()
                + torch.cummax(h, -1).values.mean() + ranked.sum() + torch.logcumsumexp(h, -1).mean()
                + torch.cumprod(torch.sigmoid(h[..., :2000]) * 0.5 + 0.75, -1).mean())


def test_long_scans_and_sorts_train_whole(fresh_dynamo):
    ours, theirs = twins(LongRows)
    x = torch.randn(4, 8)
    out, ref = torch.compile(ours, backend="stitchflow")(x), theirs(x)
    out.backward()
    ref.backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(ours.proj.weight.grad, theirs.proj.weight.grad, rtol=1e-4, atol=1e-5)
    assert not backend.FALLBACKS, backend.fallback_report()
