"""Exploration reports: one row per configuration, as a rich table, CSV, JSON and a PNG plot of
the speedup over unfused."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, astuple, dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class Row:
    config: str
    granularity: str
    regions: int
    order: str
    par: str
    block: int
    flops: float
    bytes: float
    recomputed_flops: float
    value: float | None  # cycles (dataflow) or seconds (gpu); None when pruned
    speedup: float | None  # unfused (first order/par/block of the sweep) / value
    evaluated_by: str  # static | simulator | - (pruned)
    status: str  # ok | pruned
    reason: str  # why it was pruned

    def __str__(self) -> str:
        if self.status == "pruned":
            return f"{self.config}: pruned ({self.reason})"
        return f"{self.config}: {self.value:.6g} ({self.evaluated_by}), speedup {self.speedup:.3g}"

    def key(self) -> tuple:
        """Comparable form: floats rounded so that two runs of the same sweep agree."""
        return tuple(round(v, 9 - len(str(int(abs(v))))) if isinstance(v, float) else v for v in astuple(self))


def render_table(result):
    from rich.table import Table

    unit = "cycles" if result.target == "dataflow" else "seconds"
    table = Table(title=str(result))
    for col in ("configuration", "regions", "FLOPs", "bytes", "recomputed", unit, "speedup", "evaluated by", "status"):
        table.add_column(col, justify="left" if col in ("configuration", "status") else "right")
    for r in result.rows:
        table.add_row(r.config, str(r.regions), f"{r.flops:.3g}", f"{r.bytes:.3g}", f"{r.recomputed_flops:.3g}",
                      "-" if r.value is None else f"{r.value:.4g}", "-" if r.speedup is None else f"{r.speedup:.2f}x",
                      r.evaluated_by, r.status if r.status == "ok" else f"pruned: {r.reason}")
    return table


def write_csv(rows, path: Path) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([fl.name for fl in fields(Row)])
        for r in rows:
            writer.writerow(astuple(r))
    return path


def write_json(rows, path: Path) -> Path:
    path.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return path


def write_plot(rows, path: Path, title: str) -> Path:
    """Bar per configuration: speedup over unfused; pruned configurations marked, not drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(rows) + 2), 4.5))
    labels = [r.config for r in rows]
    heights = [r.speedup or 0.0 for r in rows]
    colours = ["tab:blue" if r.status == "ok" else "lightgrey" for r in rows]
    bars = ax.bar(range(len(rows)), heights, color=colours)
    for bar, r in zip(bars, rows):
        if r.status != "ok":
            ax.text(bar.get_x() + bar.get_width() / 2, 0.02, "pruned", rotation=90, ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(f"speedup over unfused ({rows[0].evaluated_by if rows else 'static'})")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # long configuration names must not be cut
    plt.close(fig)
    return path
