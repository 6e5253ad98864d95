"""`stitchflow bench simulator` on the tiny graph: rows, files and the BENCHMARKS section."""

import json

import stitchflow
from stitchflow.apps import APPS
from stitchflow.bench import simulator


def test_simulator_bench_writes_rows_files_and_section(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\n## Other\n\nkept\n")
    assert simulator.main(["--app", "gcn", "--dataset", "tiny", "--out-dir", str(tmp_path),
                           "--markdown", str(md)]) == 0
    rows = json.loads((tmp_path / "simulator.json").read_text())["rows"]
    assert [r["fusion"] for r in rows] == ["unfused", "partial", "full"]
    model, inputs = APPS["gcn"].build(dataset="tiny")
    for r in rows:  # the cycles are the simulator's, not something the bench made up
        prog = stitchflow.compile(model, inputs, target="dataflow", fusion=r["fusion"])
        res = prog.simulate(*inputs)
        assert (r["cycles"], r["tokens"]) == (res.cycles, res.tokens)
    text = md.read_text()
    assert "## Other\n\nkept" in text and simulator.SECTION in text
    assert (tmp_path / "simulator.csv").read_text().count("\n") == 4
