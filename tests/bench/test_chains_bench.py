"""The chains bench's plumbing on the CPU: a case runs end to end with the GPU-only parts (CUDA-graph
timing, the autotuner, torch.compile) replaced, and the competitors are timed in interleaved rounds."""

import torch

import stitchflow.bench.chains as bench
import stitchflow.targets.gpu.chains as gpu_chains
from stitchflow.targets.gpu.chain_cost import Plan


def test_interleaved_rounds_take_each_competitors_median(monkeypatch):
    calls = []
    times = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 6.0, 4.0])}
    monkeypatch.setattr(bench, "bench", lambda fn: fn())
    fns = {name: (lambda name=name: calls.append(name) or next(times[name])) for name in times}
    assert bench.interleaved(fns) == {"a": 2.0, "b": 5.0}
    assert calls == ["a", "b"] * 3  # in turn, not one competitor's rounds in a row


def test_run_case_fills_a_row(monkeypatch):
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "bench", lambda fn: (fn(), 1e-6)[1])
    library = Plan("library", "eager", (("h", "hbm"),))
    report = {"first_choice": str(library), "first_choice_seconds": 1e-6, "seconds": 1e-6, "timed": []}
    monkeypatch.setattr(gpu_chains, "autotune", lambda ops, k, profile, use_cache: (library, report))
    monkeypatch.setattr(bench, "_compiled_fn", lambda fn, args, ref, mode, budget, need: (lambda: fn(*args), "stub"))
    case = bench.ChainCase("tiny", 64, 32, 48, 16)
    problem = bench.make_problem(case, None)
    problem["a"] = bench._rand((case.M, case.K))
    row = bench.run_case(case, problem, {"copy_bw": 3e12, "gemm_flops": 8e14}, None, bench.Budget(60),
                         lambda: False, 4)
    assert row["eager_s"] == row["ours_s"] == row["compile_s"] == 1e-6
    assert row["ours_ok"] and row["plan"] == str(library) and row["dsm"] == []
    torch.testing.assert_close(torch.tensor(row["ours_err"]), torch.tensor(0.0))


def test_a_check_that_must_be_refused_passes_only_on_its_refusal():
    from stitchflow.bench.chains_checks import Refusal, _run_check

    def refuse(message):
        def fn():
            raise ValueError(message)
        return fn

    expected = Refusal("16-bit operands only")
    assert _run_check(refuse("the transposed kernel takes 16-bit operands only"), expected, 1e-4)["ok"]
    assert not _run_check(refuse("N <= 256, not gated"), expected, 1e-4)["ok"]       # refused for another reason
    assert not _run_check(lambda: torch.ones(3), expected, 1e-4)["ok"]                # ran where it should refuse
    x = torch.randn(5, dtype=torch.float64)
    assert _run_check(lambda: x + 1e-9, x, 1e-4)["ok"]
    assert not _run_check(lambda: x + 1.0, x, 1e-4)["ok"]
    broken = _run_check(refuse("anything"), x, 1e-4)                                  # a broken numeric check
    assert not broken["ok"] and "ValueError" in broken["error"]
