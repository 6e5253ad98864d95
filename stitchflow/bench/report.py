"""What every benchmark suite writes: JSON and CSV next to each other, and its own section of
BENCHMARKS.md, replaced in place so that other suites' sections stay as they are."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Sequence


def replace_section(path: Path, heading: str, section: str) -> None:
    """Replace the `## heading` section of a markdown file (up to the next `## `), or append it."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find(heading)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    else:
        end = text.find("\n## ", start + len(heading))
        text = text[:start] + section.rstrip("\n") + ("\n" + text[end:] if end >= 0 else "\n")
    path.write_text(text)


def write_results(out: Path, stem: str, payload: dict, rows: Sequence[dict], fields: Sequence[str] | None = None):
    """`stem`.json holds the payload; `stem`.csv one line per row (every key, unless `fields`)."""
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1, default=str))
    fields = list(fields) if fields else sorted({k for r in rows for k in r})
    with open(out / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
