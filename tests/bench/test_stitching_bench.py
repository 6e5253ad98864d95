"""The stitching bench's timing rounds (the bench itself runs on a GPU)."""

from stitchflow.bench import stitching


def test_competitors_are_timed_in_turn_and_each_keeps_every_round(monkeypatch):
    calls = []

    def fake_time(fn, sets, cooldown_s):
        assert cooldown_s == stitching.COOLDOWN_S > 0  # every competitor starts from an idle GPU's clock
        calls.append(fn)
        return {"a": 10.0, "b": 20.0}[fn] + len(calls)

    monkeypatch.setattr(stitching, "_time", fake_time)
    times = stitching._time_in_rounds({"eager": "a", "ours": "b"}, sets=[()], rounds=3)
    assert calls == ["a", "b"] * 3  # in turn, so a stall lands in one competitor's round, not all of its
    assert times == {"eager": [11.0, 13.0, 15.0], "ours": [22.0, 24.0, 26.0]}


def test_cooldown_option_sets_the_pause_every_bench_times_with(monkeypatch, capsys):
    import argparse

    import pytest

    from stitchflow.bench import stitching_blocks, training

    monkeypatch.setattr(stitching, "COOLDOWN_S", stitching.COOLDOWN_S)  # restored after the test
    parser = argparse.ArgumentParser()
    stitching.add_cooldown_argument(parser)
    assert parser.parse_args([]).cooldown == 0.5 and stitching.COOLDOWN_S == 0.5
    assert parser.parse_args(["--cooldown", "0"]).cooldown == 0 and stitching.COOLDOWN_S == 0
    info = {"command": "cmd", "device": "GPU", "date": "today", "torch": "2", "triton": "3", "dtype": "bfloat16",
            "size": "default"}
    assert "the GPU idle 0.0 s before each runner's timed calls" in stitching_blocks.markdown([], info)
    with pytest.raises(SystemExit):
        parser.parse_args(["--cooldown", "-1"])
    for bench in (stitching, stitching_blocks, training):
        with pytest.raises(SystemExit):
            bench.main(["--help"])
        assert "--cooldown" in capsys.readouterr().out
