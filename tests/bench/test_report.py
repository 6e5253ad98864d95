"""Benchmark outputs: a suite replaces only its own section of BENCHMARKS.md."""

import csv
import json

from stitchflow.bench import report
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


def test_run_cases_keeps_a_failing_case_as_its_error(capsys):
    def bench(case):
        if case == "bad":
            raise ValueError("no such graph")
        return {"case": case, "us": 1.0, "x rounds us": [1.0, 1.0]}

    rows = report.run_cases(["good", "bad"], bench)
    assert rows == [{"case": "good", "us": 1.0, "x rounds us": [1.0, 1.0]},
                    {"case": "bad", "error": "ValueError: no such graph"}]
    assert "rounds" not in capsys.readouterr().out


def test_publish_writes_files_and_the_section(tmp_path):
    md = tmp_path / "B.md"
    md.write_text("# Benchmarks\n\n## Mine\n\nold\n\n## Other\n\nkept\n")
    report.publish(tmp_path / "out", "mine", [{"case": "a", "us": 2.0}], {"device": "GPU"}, "## Mine\n\nnew\n",
                   "## Mine", str(md))
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"mine.json", "mine.csv", "mine.md"}
    assert md.read_text() == "# Benchmarks\n\n## Mine\n\nnew\n\n## Other\n\nkept\n"
