"""Every app: eager shapes, seeding, fx traceability, and the formulas of workloads.md."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from stitchflow.apps import (APPS, GCN, GPT3Decoder, BertBlock, GraphSAGE, LlamaBlock,
                             SparseAutoencoder, load_dataset)
from stitchflow.apps.gpt3 import BlockSparseAttention
from stitchflow.apps.transformer import RMSNorm, rotate_half

APP_NAMES = sorted(APPS)


def expected_shape(name, inputs):
    if name in ("gcn", "graphsage"):
        return (inputs[1].shape[0], 8)  # the "tiny" graph has no labels: 8 classes
    if name == "resnet":
        return (inputs[0].shape[0], 10)  # class scores
    if name == "unet":
        return tuple(inputs[0].shape)  # an image of the input's shape
    return tuple(inputs[0].shape)


@pytest.mark.parametrize("name", APP_NAMES)
def test_eager_trace_and_seed(name):
    model, inputs = APPS[name].build("small", seed=0)
    assert not model.training
    with torch.no_grad():
        out = model(*inputs)
        traced = fx.symbolic_trace(model)
        torch.testing.assert_close(traced(*inputs), out, rtol=0, atol=0)
    assert tuple(out.shape) == expected_shape(name, inputs)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    again, inputs2 = APPS[name].build("small", seed=0)
    for (k, v), (k2, v2) in zip(model.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    with torch.no_grad():
        assert torch.equal(again(*inputs2), out)
    other, _ = APPS[name].build("small", seed=1)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters()))


@pytest.mark.parametrize("name", APP_NAMES)
def test_param_formats_cover_parameters(name):
    model, _ = APPS[name].build("small")
    names = [n for n, _ in model.named_parameters()]
    assert sorted(model.param_formats) == sorted(names)
    assert set(model.param_formats.values()) <= {"dense", "dcsr"}


def test_builds_leave_global_rng_alone():
    state = torch.random.get_rng_state()
    for name in APP_NAMES:
        APPS[name].build("small")
    assert torch.equal(state, torch.random.get_rng_state())


@pytest.mark.parametrize("cls", [GCN, GraphSAGE])
def test_gnn_formula_and_layouts(cls):
    data = load_dataset("cora")
    model = cls(seed=3).eval()
    a_dense = data.adjacency("dense")
    with torch.no_grad():
        outs = [model(data.adjacency(layout), data.x) for layout in ("csr", "coo", "dense")]
        l1, l2 = model.layer1, model.layer2
        x = data.x
        if cls is GCN:
            h = torch.relu(a_dense @ x @ l1.weight + l1.bias)
            ref = torch.softmax(a_dense @ h @ l2.weight + l2.bias, dim=-1)
        else:
            h = torch.relu(x @ l1.weight_self + (a_dense @ x) @ l1.weight_neigh + l1.bias)
            ref = torch.relu(h @ l2.weight_self + (a_dense @ h) @ l2.weight_neigh + l2.bias)
    assert outs[0].shape == (2708, 7)
    for out in outs:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_gnn_weights_sparse_and_formats():
    gcn = GCN(seed=0)
    assert gcn.param_formats == {"layer1.weight": "dcsr", "layer1.bias": "dense",
                                 "layer2.weight": "dcsr", "layer2.bias": "dense"}
    for w in (gcn.layer1.weight, gcn.layer2.weight):
        assert (w != 0).sum() == round(0.5 * w.numel())
    sage = GraphSAGE(in_features=32, hidden=8, out_features=4, num_layers=3, seed=0)
    assert sage.param_formats["layer3.weight_neigh"] == "dcsr"
    assert (sage.layer1.bias != 0).all()  # non-zero biases catch indexing bugs
    assert not torch.equal(gcn.layer1.weight, GCN(seed=1).layer1.weight)


def test_gnn_float64():
    model, (a, x) = APPS["gcn"].build("small", dtype=torch.float64)
    assert a.dtype == x.dtype == model.layer1.weight.dtype == torch.float64
    with torch.no_grad():
        assert model(a, x).dtype == torch.float64


def module_paths(traced):
    """{node name: the module paths on its nn_module_stack} for every op node."""
    return {node.name: [path for path, _ in node.meta.get("nn_module_stack", {}).values()]
            for node in traced.graph.nodes
            if node.op in ("call_function", "call_method", "call_module")}


def test_nn_module_stack_shows_layers():
    model, _ = APPS["gcn"].build("small")
    traced = fx.symbolic_trace(model)
    paths = module_paths(traced)
    matmuls = [n.name for n in traced.graph.nodes if "matmul" in str(n.target)]
    assert [paths[m] for m in matmuls] == [["layer1"]] * 2 + [["layer2"]] * 2
    model, _ = APPS["gpt3-bigbird"].build("small")
    traced = fx.symbolic_trace(model)
    paths = module_paths(traced)
    for region in ("qkv", "attn", "mlp"):
        for layer in (0, 1):
            assert any(f"decoders.{layer}.{region}" in p for p in paths.values()), region
    softmax = [n.name for n in traced.graph.nodes if n.target is torch.softmax]
    assert [paths[n][-1] for n in softmax] == ["decoders.0.attn", "decoders.1.attn"]
    model, _ = APPS["graphsage"].build("small")
    stacks = module_paths(fx.symbolic_trace(model)).values()
    assert all(p and p[0] in ("layer1", "layer2") for p in stacks)


def test_sae():
    model = SparseAutoencoder(128, 16, seed=2).eval()
    assert (model.encoder.weight != 0).sum() == round(0.1 * 128 * 16)
    assert model.param_formats["decoder.weight"] == "dcsr"
    assert model.param_formats["encoder.bias"] == "dense"
    x = torch.rand(32, 128)
    with torch.no_grad():
        ref = torch.relu(x @ model.encoder.weight + model.encoder.bias)
        ref = ref @ model.decoder.weight + model.decoder.bias
        torch.testing.assert_close(model(x), ref)
    with pytest.raises(KeyError):
        SparseAutoencoder.preset("mnist")


def test_bigbird_attention_matches_sdpa():
    torch.manual_seed(0)
    dec = GPT3Decoder(width=64, heads=4, ffn=128, seq=128, block=16, seed=0).eval()
    attn: BlockSparseAttention = dec.attn
    qkv = torch.randn(2, 128, 192)
    q, k, v = (t.unflatten(-1, (4, 16)).transpose(1, 2) for t in qkv.split(64, dim=-1))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=attn.mask.bool())
    with torch.no_grad():
        out = attn(qkv)
    torch.testing.assert_close(out, ref.transpose(1, 2).flatten(-2), rtol=1e-5, atol=1e-5)
    assert attn.scale == 0.25
    assert dec.buffer_formats == {"attn.mask": f"bsr{dec.block_mask.block}"}


def test_gpt3_batch_and_causal():
    dec = GPT3Decoder(width=64, heads=4, ffn=128, seq=64, block=16, seed=0).eval()
    x = torch.randn(3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(dec(x)[1], dec(x[1]), rtol=1e-5, atol=1e-5)
        causal = GPT3Decoder(width=64, heads=4, ffn=128, seq=64, block=16, causal=True).eval()
        y = x.clone()
        y[:, 40:] += 1.0
        torch.testing.assert_close(causal(x)[:, :40], causal(y)[:, :40])


def test_gpt3_full_size_decoder():
    model, (x,) = APPS["gpt3-bigbird"].build("decoder", block=64)
    assert x.shape == (1024, 768) and model.attn.scale == 0.125
    assert abs(model.block_mask.density - 0.461) < 0.015
    assert model.attn.mask.shape == (1024, 1024)
    with torch.no_grad():
        assert model(x).shape == (1024, 768)


def test_bert_mask_matches_truncation():
    block = BertBlock(use_mask=True, seed=0).eval()
    x = torch.randn(2, 32, 64)
    mask = torch.zeros(32)
    mask[20:] = float("-inf")  # keys 20.. are padding
    with torch.no_grad():
        full = block(x, mask)
        short = block(x[:, :20], mask[:20])
        traced = fx.symbolic_trace(block)
        torch.testing.assert_close(traced(x, mask), full)
    torch.testing.assert_close(full[:, :20], short, rtol=1e-5, atol=1e-5)
    assert isinstance(block.attn.dropout, torch.nn.Dropout)


def test_llama_pieces():
    x = torch.randn(2, 32, 64)
    norm = RMSNorm(64, gen=torch.Generator().manual_seed(0))
    fnorm = RMSNorm(64, functional=True)
    fnorm.load_state_dict(norm.state_dict())
    torch.testing.assert_close(norm(x), fnorm(x))
    assert torch.equal(rotate_half(torch.arange(4.0)), torch.tensor([-2.0, -3.0, 0.0, 1.0]))
    block = LlamaBlock(kv_heads=2, seed=0).eval()  # GQA: 4 heads over 2 KV heads
    assert block.attn.k_proj.weight.shape == (32, 64)
    y = x.clone()
    y[:, 25:] += 1.0
    with torch.no_grad():
        torch.testing.assert_close(block(x)[:, :25], block(y)[:, :25])  # causal
        functional = LlamaBlock(kv_heads=2, seed=0, functional_rms_norm=True).eval()
        torch.testing.assert_close(functional(x), block(x), rtol=1e-5, atol=1e-5)
        norope = LlamaBlock(kv_heads=2, seed=0, rope=False).eval()
        assert not torch.allclose(norope(x), block(x))
        torch.testing.assert_close(fx.symbolic_trace(functional)(x), functional(x))


def test_registry_sizes_and_errors():
    for name, spec in APPS.items():
        assert spec.name == name and "small" in spec.sizes and "default" in spec.sizes
    with pytest.raises(ValueError, match="size"):
        APPS["gcn"].build("huge")
    model, (a, x) = APPS["graphsage"].build("default")
    assert a.layout == torch.sparse_csr and x.shape == (2708, 1433)
    model, (a, x) = APPS["gcn"].build("small", dataset="karate")
    with torch.no_grad():
        assert model(a, x).shape == (34, 2)


def test_llama_gqa_matches_repeated_heads():
    block = LlamaBlock(kv_heads=2, rope=False, causal=True, seed=4).eval()
    attn = block.attn
    x = torch.randn(2, 32, 64)
    q = attn.q_proj(x).unflatten(-1, (4, 16)).transpose(1, 2)
    k = attn.k_proj(x).unflatten(-1, (2, 16)).transpose(1, 2).repeat_interleave(2, dim=1)
    v = attn.v_proj(x).unflatten(-1, (2, 16)).transpose(1, 2).repeat_interleave(2, dim=1)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = attn.o_proj(ref.transpose(1, 2).flatten(-2))
    with torch.no_grad():
        torch.testing.assert_close(attn(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["resnet18", "resnet50"])
def test_resnet_presets_have_torchvisions_parameter_counts(preset):
    from stitchflow.apps.resnet import RESNET_PRESETS, ResNet

    model = ResNet(**RESNET_PRESETS[preset])
    count = sum(p.numel() for p in model.parameters())
    assert count == {"resnet18": 11_689_512, "resnet50": 25_557_032}[preset]
