"""Work and traffic counters per primitive (spec/dataflow.md, "Counters"), computed from the
streams of the functional execution, so both simulation engines report the same numbers.

Memory traffic counts what crosses the region boundary: compressed coordinates and segment
bounds scanned from a region input, values read from one, coordinates and values written to
a region output. Reads and writes of on-chip accumulators and buffers are counted apart.
FLOPs: one per element of every ALU result (2·K per element for a tile multiply with
contraction K) and one per element accumulated by a reducer.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from .graph import Prim
from .stream import ELEM, Stream


@dataclass(frozen=True)
class Counters:
    tokens: int = 0
    crd_read: int = 0
    seg_read: int = 0
    val_read: int = 0
    crd_written: int = 0
    val_written: int = 0
    onchip_read: int = 0
    onchip_written: int = 0
    alu_ops: int = 0
    reduce_ops: int = 0
    flops: int = 0
    bytes: int = 0

    def __add__(self, other: "Counters") -> "Counters":
        return Counters(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __str__(self) -> str:
        return ", ".join(f"{k} {v:,}" for k, v in self.as_dict().items() if v)


def total(items) -> Counters:
    out = Counters()
    for c in items:
        out = out + c
    return out


def _elems(s: Stream) -> int:
    return int(np.count_nonzero(s.kind == ELEM))


def _tile(s) -> int:
    if isinstance(s, Stream) and s.fval is not None and s.fval.ndim > 1:
        return int(np.prod(s.fval.shape[1:]))
    return 1


def count(p: Prim, ins, outs, ctx, crd_bytes: int = 4, value_bytes: int = 4) -> Counters:
    c = dict(tokens=sum(len(o) for o in outs if isinstance(o, Stream)))
    memory = ctx.from_memory(p.ins[0]) if p.ins else False
    if p.kind == "scan" and ctx.producers[p.ins[0]].kind != "root":
        compressed = ins[0].levels[p.param("level")].kind != "d"
        if compressed and memory:
            c["crd_read"] = _elems(outs[0])
            c["seg_read"] = 2 * _elems(ins[1])
        elif compressed:
            c["onchip_read"] = _elems(outs[0])
    elif p.kind == "read":
        n = _elems(ins[1]) * _tile(outs[0])
        c["val_read" if memory else "onchip_read"] = n
    elif p.kind in ("write", "buffer_write"):
        *crds, vals, _ = ins
        crd = sum(_elems(x) for x in crds)
        val = _elems(vals) * _tile(vals)
        if p.kind == "write":
            c["crd_written"], c["val_written"] = crd, val
        else:
            c["onchip_written"] = crd + val
    elif p.kind == "alu":
        ops = _elems(outs[0])
        c["alu_ops"] = ops
        c["flops"] = ops * _tile(outs[0]) * _contraction(p, ins, outs)
    elif p.kind == "reduce" or (p.kind in ("spacc", "buffer") and p.param("reduced")):
        ops = _elems(ins[0])
        c["reduce_ops"] = ops
        c["flops"] = ops * _tile(ins[0])
    c["bytes"] = (c.get("crd_read", 0) + c.get("seg_read", 0) + c.get("crd_written", 0)) * crd_bytes \
        + (c.get("val_read", 0) + c.get("val_written", 0)) * value_bytes
    return Counters(**c)


def _contraction(p: Prim, ins, outs) -> int:
    """2·K for a tile multiply contracting K elements (in0·in1 = K²·out), else 1."""
    if not p.param("contract"):
        return 1
    tiles = [_tile(x) for x in ins if isinstance(x, Stream)]
    if len(tiles) < 2:
        return 1
    k = int(round((tiles[0] * tiles[1] / _tile(outs[0])) ** 0.5))
    return 2 * max(k, 1)
