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


def run_cases(cases, bench) -> list[dict]:
    """`bench(case)` for each case, a failure kept as the case's row with its error; each row printed
    (without its per-round lists) as it finishes."""
    rows = []
    for case in cases:
        try:
            rows.append(bench(case))
        except Exception as err:  # report and go on with the next case
            rows.append({"case": case, "error": f"{type(err).__name__}: {err}"})
        print({k: v for k, v in rows[-1].items() if "rounds" not in k}, flush=True)
    return rows


def device_info(command: str, **extra) -> dict:
    """Where and when a GPU bench ran: command, device, date, torch and triton versions, and `extra`."""
    import datetime

    import torch
    import triton

    return {"command": command, "device": torch.cuda.get_device_name(),
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
            "triton": triton.__version__, **extra}


def publish(out: Path, stem: str, rows: list[dict], info: dict, section: str, heading: str,
            markdown: str = "") -> None:
    """`stem`.json, .csv and .md under `out`; the section also replaces `heading` in `markdown` if given."""
    out.mkdir(parents=True, exist_ok=True)
    write_results(out, stem, {"info": info, "rows": rows}, rows)
    (out / f"{stem}.md").write_text(section)
    if markdown:
        replace_section(Path(markdown), heading, section)
    print(section)


def us_cell(row: dict, name: str) -> str:
    """A competitor's median µs for a table, or "failed" when it did not run or did not match."""
    return f"{row[name + ' us']:.1f}" if row.get(name + " us") else "failed"


def failure_lines(rows: list[dict], runners, against: str) -> list[str]:
    """The markdown list of competitors that did not run or did not match `against`, with their reasons."""
    failures = [f"{r['case']} {name}: {r[name + ' error']}" for r in rows for name in runners if r.get(name + " error")]
    if not failures:
        return []
    return ["", f"Competitors that did not run or did not match {against}:", ""] + [f"- {f}" for f in failures]


def run_apps(args, argv, module: str, bench, markdown) -> int:
    """The main of a suite over models of the zoo: `bench(app, dtype, size)` for each APP or APP:SIZE of
    --apps (a failure kept as that model's row), each row printed as it finishes; then --out (the rows as
    JSON) and --markdown (the suite's section, `markdown(rows, info)`, rewritten with the command, device,
    date and versions)."""
    import datetime
    import sys

    import torch

    rows = []
    for spec in args.apps.split(","):
        app, _, size = spec.partition(":")  # resnet:resnet50 names a size of its own
        try:
            rows.append(bench(app, getattr(torch, args.dtype), size or args.size))
        except Exception as err:  # report and go on with the next model
            rows.append({"app": app, "error": f"{type(err).__name__}: {err}"})
        print(json.dumps(rows[-1], default=str), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1, default=str))
    if args.markdown:
        import triton

        info = {"command": f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:]),
                "device": torch.cuda.get_device_name(), "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
                "torch": torch.__version__, "triton": triton.__version__, "dtype": args.dtype, "size": args.size,
                "section": args.section}
        section = markdown(rows, info)
        replace_section(Path(args.markdown), args.section, section)
        print(section)
    return 0


def app_row_start(row: dict, runners: Sequence[str]) -> tuple[str, float]:
    """The cells a zoo suite's table row opens with (model, input shape, each runner's µs: "failed" where it
    failed its check, "-" where it did not run) and the largest relative error of the runners after the first."""
    times = [f"{row[f'{n} us']:.0f}" if row.get(f"{n} us") else "failed" if f"{n} error" in row else "-"
             for n in runners]
    worst = max((e for e in (row.get(f"{n} err") for n in runners[1:]) if e is not None), default=float("nan"))
    shape = "x".join(map(str, row["shapes"][0])) if row.get("shapes") else ""
    name = row["app"] if row.get("size", "default") == "default" else f"{row['app']} {row['size']}"
    return f"| {name} | {shape} | " + " | ".join(times), worst


def app_table_rows(rows: list[dict], runners: Sequence[str], tail) -> list[str]:
    """A zoo suite's table rows: a failed app's one line, else `app_row_start`'s cells followed by
    `tail(row, worst)` (the suite's own cells, from " | " on)."""
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['app']} | failed: {r['error'][:100]} |")
            continue
        start, worst = app_row_start(r, runners)
        lines.append(start + tail(r, worst))
    return lines


def speedup_cell(r: float | None) -> str:
    """A table cell for a speedup: "**1.23x faster**", "0.88x (13.6% slower)", or "n/a"."""
    if r is None:
        return "n/a"
    return f"**{r:.2f}x faster**" if r >= 1 else f"{r:.2f}x ({(1 / r - 1):.1%} slower)"


def provenance_lines(info: dict) -> list[str]:
    """A section's command and device lines (markdown line breaks at their ends)."""
    return [f"Command: `{info['command']}`  ",
            f"Device: {info['device']}; {info['date']}; torch {info['torch']}, triton {info['triton']}  "]
