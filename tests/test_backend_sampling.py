"""Generation's logits processors (Hugging Face's temperature, repetition penalty, top-k, top-p and min-p) through
torch.compile(backend="stitchflow") over a vocabulary past QUADRATIC_SORT and QUADRATIC_SCAN: top-p sorts the whole
vocabulary (merge-ranked) and takes a cumulative sum of its probabilities (scanned in blocks), then scatters the
mask back; each compiles whole and equals eager exactly."""

import pytest
import torch

from stitchflow import backend
from stitchflow.frontend import ops_scan, ops_sort

processors = pytest.importorskip("transformers.generation.logits_process")

VOCAB = 3000
assert VOCAB > max(ops_sort.QUADRATIC_SORT, ops_scan.QUADRATIC_SCAN)


def _chain():
    return [processors.TemperatureLogitsWarper(0.7), processors.RepetitionPenaltyLogitsProcessor(1.2),
            processors.TopKLogitsWarper(50), processors.TopPLogitsWarper(0.9), processors.MinPLogitsWarper(0.05)]


def _process(chain, ids, scores):
    for p in chain:
        scores = p(ids, scores)
    return scores


@pytest.mark.parametrize("which", ["top_p", "whole_chain"])
def test_sampling_processors_compile_whole(which, fresh_dynamo):
    g = torch.Generator().manual_seed(0)
    scores, ids = torch.randn(2, VOCAB, generator=g), torch.randint(0, VOCAB, (2, 7), generator=g)
    chain = _chain() if which == "whole_chain" else [processors.TopPLogitsWarper(0.8)]
    compiled = torch.compile(lambda i, s: _process(chain, i, s), backend="stitchflow")
    assert torch.equal(compiled(ids, scores), _process(chain, ids, scores))
    assert not backend.FALLBACKS, backend.fallback_report()
    assert backend.COMPILED
