"""Exploration end to end on GCN (small) with static evaluation, through local processes and
through a local Dask cluster on loopback: same table either way."""

from __future__ import annotations

import csv
import json

import pytest

from stitchflow.planner.explore import Config, explore, main, parse_par

SWEEP = dict(dataset=None, size="small", target="dataflow", orders=(None, 0), par=({}, {"i": 4}), blocks=(None,))


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    out = tmp_path_factory.mktemp("explore")
    return explore("gcn", executor=None, out_dir=out, progress=False, **SWEEP), out


def test_explore_writes_table_csv_json_png(local):
    result, out = local
    names = {r.granularity for r in result.rows}
    assert {"unfused", "per-layer", "full", "auto", "layer1 only", "layer2 only"} <= names
    assert any(n.startswith("lin1+bias+relu+adj2") for n in names)
    assert sorted(p.rsplit(".", 1)[1] for p in result.files) == ["csv", "json", "png"]
    rows = list(csv.DictReader(open(next(p for p in result.files if p.endswith(".csv")))))
    assert len(rows) == len(result.rows) == 8 * 2 * 2  # 8 granularities x 2 orders x 2 parallel factors
    data = json.load(open(next(p for p in result.files if p.endswith(".json"))))
    assert {d["evaluated_by"] for d in data if d["status"] == "ok"} == {"simulator"}  # the dataflow simulator exists
    png = open(next(p for p in result.files if p.endswith(".png")), "rb").read(8)
    assert png.startswith(b"\x89PNG")


def test_auto_is_no_worse_than_unfused_partial_full(local):
    result, _ = local
    best = {}
    for r in result.rows:
        if r.status == "ok" and r.order == "best" and r.par == "1":
            best[r.granularity] = r.value
    others = [best[g] for g in ("unfused", "per-layer", "full") if g in best]
    assert best["auto"] <= min(others) * (1 + 1e-9)


def test_pruned_rows_carry_reasons(local):
    result, _ = local
    for r in result.rows:
        assert (r.status in ("pruned", "refused")) == bool(r.reason)
        if r.status == "ok":
            assert r.value > 0 and r.speedup > 0


def test_dask_cluster_gives_the_same_table(local, tmp_path):
    distributed = pytest.importorskip("dask.distributed", reason="dask[distributed] is not installed")
    result, _ = local
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                  dashboard_address=None) as cluster:
        remote = explore("gcn", executor=cluster.scheduler_address, out_dir=tmp_path, progress=False, **SWEEP)
    assert remote.table() == result.table()


def test_cli_main_and_knob_parsing(tmp_path, capsys):
    assert parse_par("1") == {} and parse_par("4x4") == {"i": 4, "j": 4} and parse_par("i=4,k=2") == {"i": 4, "k": 2}
    assert Config("auto", (("a",),), 1, ((0, 4),), 16).options == {"order": 1, "par": {0: 4}, "block": 16}
    from concurrent.futures import ThreadPoolExecutor

    import stitchflow.planner.explore as ex

    with ThreadPoolExecutor(2) as pool:  # in-process: the CLI path without spawning workers
        result = ex.explore("sae", size="small", executor=pool, out_dir=tmp_path, progress=False)
    assert result.rows and all(r.status in ("ok", "pruned", "refused") for r in result.rows)
    assert main(["sae", "--size", "small", "--out", str(tmp_path), "--par", "1", "2"]) == 0
    assert "evaluated by" in capsys.readouterr().out
