"""The Hugging Face models the benchmarks take (apps/hf.py): seeded, small sizes runnable on the CPU, and
build_model's dispatch between them and the zoo."""

import pytest
import torch

from stitchflow.apps import APPS, HF_MODELS, build_model

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_small_models_are_seeded_and_dropout_free(name):
    model, (ids,) = build_model(name, "small", seed=0)
    again, (ids2,) = build_model(name, "small", seed=0)
    other, _ = build_model(name, "small", seed=1)
    assert torch.equal(ids, ids2) and ids.dtype == torch.long and not model.training
    with torch.no_grad():
        out = model(ids)
        assert torch.equal(again(ids2), out) and not torch.equal(other(ids), out)
    assert out.shape[:2] == ids.shape and torch.isfinite(out).all()
    model.train()
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


def test_build_model_takes_apps_of_the_zoo_and_names_the_unknown():
    model, inputs = build_model("llama", "small")
    assert isinstance(model, type(APPS["llama"].build("small")[0]))
    with pytest.raises(ValueError, match="unknown model 'gpt5'.*hf-llama"):
        build_model("gpt5")
    with pytest.raises(ValueError, match="unknown size"):
        build_model("hf-gpt2", "huge")


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_padded_sizes_carry_a_mask_of_different_lengths(name):
    model, (ids, mask) = build_model(name, "small-padded")
    assert mask.shape == ids.shape and mask.dtype == torch.long
    lengths = mask.sum(1).tolist()
    assert lengths[0] == ids.shape[1] and lengths == sorted(lengths, reverse=True) and lengths[-1] < ids.shape[1]
    causal = name != "hf-bert"  # causal LMs are padded on the left, encoders on the right
    assert bool(mask[-1, -1 if causal else 0]) and not bool(mask[-1, 0 if causal else -1])
    with torch.no_grad():
        out = model(ids, mask)
    assert out.shape[:2] == ids.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("size", ["small", "small-padded"])
@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_stitchflow_compile_takes_the_models_and_equals_eager(name, size):
    """Not only torch.compile(backend="stitchflow"): stitchflow.compile exports them (symbolic tracing fails on
    their control flow), and the export's empty key/value-cache constant is captured as a constant."""
    import stitchflow

    model, inputs = build_model(name, size)
    prog = stitchflow.compile(model, inputs)
    _, fresh = build_model(name, size, seed=7)
    with torch.no_grad():
        out, ref = prog(*fresh), model(*fresh)
    assert out.shape == ref.shape
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,layers", [("hf-gpt2", "model.transformer.h"), ("hf-opt", "model.model.decoder.layers")])
def test_partial_fusion_takes_one_region_per_transformer_layer(name, layers):
    """Per-layer fusion finds the layers under transformers' wrappers (GPT-2's transformer.h.0 sits three calls deep,
    OPT's decoder.layers.0 four): the code outside them (embeddings, final norm, head) is top-level code, which
    joins the layer it finishes (regions.by_layer)."""
    import stitchflow

    model, inputs = build_model(name, "small")
    prog = stitchflow.compile(model, inputs, fusion="partial")
    assert {n.group for n in prog.graph.nodes} == {"", f"{layers}.0", f"{layers}.1"}
    layer_regions = [r for r in prog.regions if prog.graph.node_of[r.nodes[0]].group.startswith(layers)]
    assert len(layer_regions) == 2
    assert all(len({prog.graph.node_of[n].group for n in r.nodes} - {""}) <= 1 for r in prog.regions)
    with torch.no_grad():
        assert torch.allclose(prog(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)
