"""The attention bench on the CPU: its competitors compute the app's attention (the boolean mask for SDPA, the
mask_mod for FlexAttention, stitchflow's kernel under the interpreter), and the table reports failures."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from stitchflow.apps.bigbird import bigbird_block_mask
from stitchflow.apps.gpt3 import BlockSparseAttention, _mask_tensor
from stitchflow.bench import attention


def test_parse_case():
    assert attention.parse_case("b2h16s4096b64") == (2, 16, 4096, 64)
    assert attention.parse_case("gpt3b32") == (1, 12, 1024, 32)
    with pytest.raises(ValueError, match="is neither b<batch>"):
        attention.parse_case("2x16x4096")


def test_competitors_compute_the_apps_attention():
    heads, seq, block = 2, 128, 16
    mask = bigbird_block_mask(seq, block, seed=0)
    model = BlockSparseAttention(heads * 64, heads, _mask_tensor(mask, seq, False, torch.float32))
    qkv = torch.randn(1, seq, 3 * heads * 64)
    with torch.no_grad():
        ref = model(qkv)
        makers = attention.competitors(model, qkv, mask.layout, block, heads, compile_flex=False)
        for name in ("sdpa_mask", "flex", "stitchflow"):
            got = makers[name]()(qkv)
            assert got.shape == ref.shape
            assert attention.relative_error(got, ref) < 1e-5, name
        assert attention.relative_error(makers["dense_flash"]()(qkv), ref) > 1e-2  # no mask: another result


def test_markdown_reports_ratios_and_failures():
    row = {"case": "b1h12s1024b16", "density": 0.134, "eager us": 160.0, "torch.compile us": 109.0,
           "sdpa_mask us": 35.0, "dense_flash us": 17.5, "stitchflow us": 10.0, "stitchflow tflops": 100.0,
           "gemm tflops": 700.0, "flex error": "InductorError: no", "stitchflow plan": "attention: bm64 bn64"}
    info = {"command": "stitchflow bench attention", "device": "GPU", "date": "today", "torch": "2",
            "triton": "3", "gemm_tflops": 700.0}
    model = {"case": "gpt3b16", "density": 0.134, "eager us": 3000.0, "torch.compile us": 2000.0,
             "stitchflow us": 1000.0}
    text = attention.markdown([row, {"case": "b2h16s4096b64", "error": "OutOfMemoryError"}, model], info)
    assert "| gpt3b16 (whole model) | 13.4% | 3000.0 | 2000.0 | - | - | - | 1000.0 | 3.00x | 2.00x |" in text
    assert ("| b1h12s1024b16 | 13.4% | 160.0 | 109.0 | 35.0 | failed | 17.5 | 10.0 | 16.00x | 10.90x | 3.50x | - "
            "| 1.75x | 100 (14%) |") in text
    assert "b1h12s1024b16 flex: InductorError: no" in text and "b1h12s1024b16: attention: bm64 bn64" in text
    assert "| b2h16s4096b64 | failed: OutOfMemoryError |" in text


def test_main_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        attention.main(["--cases", "b1h2s128b16"])
