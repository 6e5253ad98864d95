"""Benchmark outputs: a suite replaces only its own section of BENCHMARKS.md."""

import csv
import json

from stitchflow.bench.report import replace_section, write_results


def test_sections_are_replaced_in_place(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    replace_section(md, "## A", "## A\nold a\n")
    replace_section(md, "## B", "## B\nb\n")
    replace_section(md, "## A", "## A\nnew a\n")
    text = md.read_text()
    assert text == "# Benchmarks\n\n## A\nnew a\n\n## B\nb\n"


def test_json_and_csv(tmp_path):
    rows = [{"case": "x", "us": 1.5}, {"case": "y", "us": 2.0, "note": "z"}]
    write_results(tmp_path, "suite", {"rows": rows}, rows)
    assert json.loads((tmp_path / "suite.json").read_text())["rows"] == rows
    read = list(csv.DictReader(open(tmp_path / "suite.csv")))
    assert [r["case"] for r in read] == ["x", "y"] and read[1]["note"] == "z"
