"""The stitchflow CLI: every verb answers --help, and the main verbs work on small apps."""

import json
import subprocess
import sys

import pytest

from stitchflow.cli import build_parser, main

VERBS = ["apps", "ops", "show", "run", "explain", "explore", "simulate", "bench", "cache"]


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_has_help(verb, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([verb, "--help"])
    assert exit_info.value.code == 0
    assert "usage: stitchflow" in capsys.readouterr().out


def test_top_level_help_lists_the_verbs():
    text = build_parser().format_help()
    assert all(v in text for v in VERBS)


def test_show_json_and_run(capsys):
    assert main(["show", "gcn", "--size", "small", "--fusion", "unfused", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert len(summary["regions"]) == 8 and summary["inputs"]
    assert main(["run", "sae", "--fusion", "full", "--json"]) == 0
    assert '"relative_error"' in capsys.readouterr().out


def test_explain_and_formats(capsys):
    assert main(["explain", "gcn", "--size", "small", "--fusion", "auto", "--format", "0=dcsr"]) == 0
    out = capsys.readouterr().out
    assert "dcsr" in out and "producer -> consumer" in out


def test_errors_are_reported_not_raised(capsys):
    assert main(["show", "gcn", "--size", "small", "--format", "0=zzz"]) == 2
    assert "unknown format name" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="unknown app"):
        main(["show", "nope"])


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "stitchflow.cli", "apps"], capture_output=True, text=True, check=True)
    assert "gcn" in out.stdout


def test_ops_lists_the_lowerings_by_names_torch_has(capsys):
    import importlib

    import torch

    assert main(["ops", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    names = {r["op"] for r in rows}
    assert {"torch.nn.functional.hardswish", "Tensor.var", "torch.gather", "aten.addmm"} <= names
    assert any(r["refused_before_capture"] for r in rows if r["op"] == "torch.nn.functional.embedding")
    for name in names:  # every listed name is one a user can call
        if name.startswith("Tensor."):
            assert hasattr(torch.Tensor, name[7:]), name
        elif name.startswith("torch."):
            module, _, attr = name.rpartition(".")
            assert hasattr(importlib.import_module(module), attr), name
    assert main(["ops", "--grep", "POOL", "--family", "pool"]) == 0
    assert "max_pool2d" in capsys.readouterr().out


def test_cache_lists_and_clears_what_stitchflow_keeps(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STITCHFLOW_CACHE", str(tmp_path))
    monkeypatch.setenv("STITCHFLOW_PLAN_CACHE", "1")
    assert main(["cache", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"root": str(tmp_path), "entries": []}
    assert main(["explain", "gcn", "--size", "small", "--fusion", "auto"]) == 0  # plans and keeps the plan
    (tmp_path / "gpu" / "kernels").mkdir(parents=True)
    (tmp_path / "gpu" / "kernels" / "k_0.py").write_text("kernel = None\n")
    capsys.readouterr()
    assert main(["cache", "--json"]) == 0
    entries = {e["path"]: e for e in json.loads(capsys.readouterr().out)["entries"]}
    assert entries["plans"]["files"] >= 1 and entries["gpu/kernels"] == {"path": "gpu/kernels", "files": 1, "bytes": 14}
    assert main(["cache"]) == 0 and "gpu/kernels" in capsys.readouterr().out
    assert main(["cache", "--clear", "plans"]) == 0
    assert not (tmp_path / "plans").exists() and (tmp_path / "gpu" / "kernels" / "k_0.py").exists()
    assert main(["cache", "--clear", "all"]) == 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("suite", ["stitching", "blocks", "chains", "training"])
def test_bench_suites_take_their_own_help(suite, capsys):
    """`stitchflow bench SUITE --help` reaches the suite's own parser (the GPU benches parse on any machine)."""
    with pytest.raises(SystemExit) as exit_:
        main(["bench", suite, "--help"])
    assert exit_.value.code == 0 and "usage:" in capsys.readouterr().out


def test_app_verbs_take_the_hugging_face_models(capsys):
    pytest.importorskip("transformers")
    assert main(["run", "hf-llama", "--size", "small-padded", "--json"]) == 0
    assert "hf-gpt2" in (main(["apps"]), capsys.readouterr().out)[1]
    with pytest.raises(SystemExit, match="unknown size 'huge'"):
        main(["show", "hf-opt", "--size", "huge"])
