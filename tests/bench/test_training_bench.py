"""The training-step bench: its correctness check on the CPU (every runner's output and gradients
against eager's, untimed; the timing runs on a GPU) and its report."""

import torch

from stitchflow.bench import training


def test_every_runner_gets_eagers_gradients_on_a_small_llama_block():
    row = training.bench_training("llama", torch.float32, "small", device="cpu", timed=False)
    assert row["checked"] == sorted(training.RUNNERS), row
    assert row["backend=stitchflow eager parts"] == []  # RoPE's slice gradients (slice_scatter) lower too
    assert row["backend=stitchflow err"] < 1e-4
    assert row["backend=stitchflow first step s"] > 0


def test_half_precision_runners_are_judged_against_the_step_in_float64():
    row = training.bench_training("bert", torch.bfloat16, "small", device="cpu", timed=False,
                                  runners=("backend=stitchflow",))
    assert row["checked"] == ["backend=stitchflow", "eager"], row
    assert 0 < row["eager err64"] < 2e-2 and row["backend=stitchflow err64"] <= max(2e-2, 2 * row["eager err64"])


def test_a_runner_further_off_float64_than_eager_is_named(monkeypatch):
    runner = training._runner
    monkeypatch.setattr(training, "_runner", lambda name, model, options=None: (
        (lambda *a: runner(name, model)(*a) * 1.5) if name != "eager" else runner(name, model)))
    row = training.bench_training("bert", torch.bfloat16, "small", device="cpu", timed=False,
                                  runners=("backend=stitchflow",))
    assert row["checked"] == ["eager"]
    assert row["backend=stitchflow error"].startswith("tensor 0 (0: the output) is 5.0")


def test_gradient_errors_floor_a_gradient_that_is_zero_in_exact_arithmetic():
    out, big, noise = torch.ones(3), torch.full((4,), 10.0), torch.full((2,), 1e-7)
    errs = training._gradient_errors([out, big, -noise], [out, big, noise])
    assert errs[0] == 0 and errs[1] == 0 and errs[2] < 1e-4  # noise against noise, floored at 1e-3 of |big|
    assert training._gradient_errors([out * 2, big, noise], [out, big, noise])[0] == 1.0  # the output is not floored


def test_markdown_reports_steps_ratios_and_what_ran_eagerly():
    row = {"app": "bert", "shapes": [[1, 512, 768]], "eager us": 1200.0, "torch.compile us": 900.0,
           "backend=stitchflow us": 750.0, "backend=stitchflow recompute us": 1500.0,
           "backend=stitchflow err": 3e-3, "torch.compile err": 2e-3, "backend=stitchflow recompute err": 1e-3,
           "backend=stitchflow vs eager": 1.6, "backend=stitchflow vs compile": 1.2,
           "backend=stitchflow eager parts": ["backward graph: aten.foo (foo): no lowering to the IR"],
           "torch.compile first step s": 41.5, "backend=stitchflow first step s": 63.2}
    info = {"command": "cmd", "device": "GPU", "date": "today", "torch": "2", "triton": "3", "dtype": "bfloat16",
            "size": "default"}
    text = training.markdown([row], info)
    assert text.startswith(training.SECTION)
    assert ("| bert | 1x512x768 | 1200 | 900 | 750 | 1500 | - | **1.60x faster** | **1.20x faster** | 3.0e-03 | 41.5 / 63.2 |"
            in text)
    assert "bert: ran eagerly under stitchflow: backward graph: aten.foo: no lowering to the IR" in text


def test_markdown_counts_repeated_fallbacks_once():
    parts = [f"backward graph: aten.convolution_backward.default (convolution_backward_{i}): no lowering to the IR"
             for i in range(20)] + ["forward graph: aten.foo.default (foo): no lowering to the IR"]
    assert training._grouped_fallbacks(parts) == [
        "backward graph: aten.convolution_backward.default: no lowering to the IR (20 nodes)",
        "forward graph: aten.foo.default: no lowering to the IR"]


def test_a_chosen_runner_is_checked_against_eager_alone():
    row = training.bench_training("bert", torch.float32, "small", device="cpu", timed=False,
                                  runners=("backend=stitchflow",))
    assert row["checked"] == ["backend=stitchflow", "eager"] and "torch.compile err" not in row


def test_unknown_runners_are_named():
    import pytest

    with pytest.raises(SystemExit, match="unknown runners \\['inductor'\\]"):
        training.main(["--runners", "eager,inductor"])


def test_a_hugging_face_model_trains_through_every_runner():
    """hf-llama: transformers' LlamaForCausalLM (key/value cache, SDPA attention, tied embeddings), small."""
    import pytest

    pytest.importorskip("transformers")
    row = training.bench_training("hf-llama", torch.float32, "small", device="cpu", timed=False,
                                  runners=("backend=stitchflow",))
    assert row["checked"] == ["backend=stitchflow", "eager"], row
    assert row["backend=stitchflow eager parts"] == []
    assert row["backend=stitchflow err"] < 1e-4
