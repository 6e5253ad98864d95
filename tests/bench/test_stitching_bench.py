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
