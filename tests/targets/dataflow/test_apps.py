"""FuseFlow's four apps at small sizes under the three fusion configurations equal eager."""

import time

import pytest
import torch

import stitchflow
from stitchflow.apps import APPS, GPT3, GPT3Decoder
from stitchflow.targets.dataflow import dataflows, describe, export

FUSIONS = ["unfused", "partial", "full"]


def close(out, ref):
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("app", ["gcn", "graphsage", "sae"])
def test_small_apps(app, fusion):
    model, inputs = APPS[app].build(size="small")
    prog = stitchflow.compile(model, inputs, target="dataflow", fusion=fusion)
    close(prog(*inputs), model(*inputs))
    assert prog.regions_executed == len(prog.regions)


@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("block", [16, 32])
def test_gpt3_bigbird_decoder_seq256(block, fusion):
    torch.manual_seed(0)
    model = GPT3Decoder(width=32, heads=2, ffn=64, seq=256, block=block).eval()
    x = torch.randn(256, 32)
    prog = stitchflow.compile(model, (x,), target="dataflow", fusion=fusion)
    close(prog(x), model(x))


def test_gpt3_two_decoders_full():
    torch.manual_seed(0)
    model = GPT3(num_layers=2, width=32, heads=2, ffn=64, seq=256, block=16).eval()
    x = torch.randn(256, 32)
    prog = stitchflow.compile(model, (x,), target="dataflow", fusion="full")
    close(prog(x), model(x))


@pytest.mark.parametrize("app", ["gcn", "graphsage"])
def test_gnn_on_cora_partial(app):
    model, inputs = APPS[app].build(size="default")
    prog = stitchflow.compile(model, inputs, target="dataflow", fusion="partial")
    close(prog(*inputs), model(*inputs))


def test_gcn_on_cora_full_fusion_runs_in_seconds():
    model, inputs = APPS["gcn"].build(size="default")
    prog = stitchflow.compile(model, inputs, target="dataflow", fusion="full")
    start = time.perf_counter()
    out = prog(*inputs)
    elapsed = time.perf_counter() - start
    close(out, model(*inputs))
    print(f"GCN/Cora full fusion: {elapsed:.1f} s, {prog._compiled[0].tokens / 1e6:.0f} M tokens")
    assert elapsed < 60


def test_inspection(tmp_path):
    model, inputs = APPS["gcn"].build(size="small")
    prog = stitchflow.compile(model, inputs, target="dataflow", fusion="partial")
    text = describe(prog, streams=True)
    assert "dataflow r0" in text and "scan" in text and "s0:ref(root)" in text
    paths = export(prog, tmp_path / "gcn", ("dot", "json", "svg"))
    names = {p.name for p in paths}
    assert "gcn.json" in names and "gcn.r0.dot" in names
    assert len(dataflows(prog)) == 2
