"""Inspection of compiled dataflow programs: a text summary, DOT (rendered to SVG/PNG when
Graphviz's `dot` is installed) and JSON. `stitchflow show APP --target dataflow` calls these."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from .graph import Dataflow

_COLOR = {"scan": "lightblue", "range": "lightblue", "locate": "lightblue", "join": "orange",
          "repeat": "khaki", "repsig": "khaki", "read": "palegreen", "load": "lightgrey",
          "alu": "pink", "fill": "pink", "reduce": "plum", "spacc": "plum", "buffer": "plum",
          "iota": "khaki", "write": "lightgrey", "fork": "cyan", "join_lanes": "cyan", "root": "white"}


def _graphs(prog) -> list[Dataflow]:
    from .target import dataflows

    if isinstance(prog, Dataflow):
        return [prog]
    if isinstance(prog, (list, tuple)):
        return list(prog)
    return dataflows(prog)


def describe(prog, streams: bool = False) -> str:
    """Regions, their orders, primitive counts and (optionally) every primitive and stream."""
    lines = []
    for df in _graphs(prog):
        lines.append(str(df))
        outs = ", ".join(o.name for o in df.outputs)
        lines.append(f"  writes {outs}; variables " + " ".join(f"{v}={n}" for v, n in df.extents))
        lines += [f"  note: {n}" for n in df.notes]
        if streams:
            lines += [f"  {p}" for p in df.prims]
            lines += [f"    {s}" for s in df.streams]
    return "\n".join(lines)


def to_dot(df: Dataflow) -> str:
    lines = [f'digraph "{df.region}" {{', "  rankdir=TB; node [shape=box, style=filled, fontsize=10];"]
    producer = {}
    for p in df.prims:
        for s in p.outs:
            producer[s] = p.id
        color = _COLOR.get(p.kind, "white")
        label = f"{p.kind}\\n{p.label}".replace('"', "'")
        lines.append(f'  p{p.id} [label="{label}", fillcolor="{color}"];')
    for p in df.prims:
        for s in p.ins:
            if s in producer:
                info = df.streams[s]
                lines.append(f'  p{producer[s]} -> p{p.id} [label="{info.kind}", fontsize=8];')
    lines.append("}")
    return "\n".join(lines)


def to_json(prog) -> dict:
    return {"regions": [{
        "region": df.region, "order": list(df.order), "notes": list(df.notes),
        "extents": dict(df.extents), "outputs": [o.name for o in df.outputs],
        "primitives": [{"id": p.id, "kind": p.kind, "label": p.label, "ins": list(p.ins), "outs": list(p.outs),
                        "lane": list(p.lane), "params": {k: _jsonable(v) for k, v in p.params}} for p in df.prims],
        "streams": [{"id": s.id, "kind": s.kind, "label": s.label, "depth": list(s.depth)} for s in df.streams],
    } for df in _graphs(prog)]}


def _jsonable(v):
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    return str(v)


def export(prog, path_prefix, formats=("dot", "json")) -> list[Path]:
    """Write `<prefix>.json` and `<prefix>.<region>.dot` (plus .svg/.png when asked and Graphviz
    is installed); returns the paths written."""
    prefix = Path(path_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    written = []
    if "json" in formats:
        path = prefix.with_name(prefix.name + ".json")
        path.write_text(json.dumps(to_json(prog), indent=1))
        written.append(path)
    dot_bin = shutil.which("dot")
    for df in _graphs(prog):
        base = f"{prefix.name}.{df.region}"
        if {"dot", "svg", "png"} & set(formats):
            dot_path = prefix.with_name(base + ".dot")
            dot_path.write_text(to_dot(df))
            if "dot" in formats:
                written.append(dot_path)
            for fmt in ("svg", "png"):
                if fmt in formats and dot_bin:
                    out = prefix.with_name(f"{base}.{fmt}")
                    subprocess.run([dot_bin, f"-T{fmt}", str(dot_path), "-o", str(out)], check=True)
                    written.append(out)
    return written
