"""The dataflow graph of one region: primitives (spec/dataflow.md, "Primitives") connected by
streams, as small immutable values printable in one line each.

Primitive kinds and their inputs -> outputs (streams are ids into `Dataflow.streams`):

  root                      -> ref          the ref stream `0 D`
  load(tensor)              -> storage      a region input stored as a fibertree (memory)
  scan(level)       storage, ref -> crd, ref   level scanner (dense or compressed)
  range(size)       driver  -> crd           dense scanner of a level that no tensor stores
  locate(size)      crd, ref -> ref          dense level located at a joined coordinate
  repsig            crd     -> signal        repeat-signal generator
  repeat            x, signal -> x'          broadcast over a variable x lacks
  join(formula)     n x (crd, ref) -> crd, n refs   intersect / union / mixed joiner
  read              storage, ref -> val      array read (N reads as zero)
  alu(op)           vals    -> val           unary/binary/ternary ALU, constants as params
  fill(value)       driver  -> val           a constant value stream
  reduce(op)        val, parent -> val       reduction of the innermost level
  spacc(op)         val, crds..., parent -> storage   sparse accumulator (non-innermost reduction)
  buffer(dense)     val, crds..., parent -> storage   on-chip buffer of a nested result (dense: leading levels by address)
  iota              parent  -> ref           refs into a buffer's first level
  fork(P)           stream  -> P streams     deals one level's items round-robin to P lanes
  join_lanes(P)     lanes   -> merged        merges lanes back fiber by fiber
  write(name)       crds..., val, parent -> tensor   level writers and value writer
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StreamInfo:
    id: int
    kind: str  # crd | ref | val | signal | storage | tensor
    label: str
    depth: tuple[str, ...] = ()  # the loop variables the stream is nested in

    def __str__(self) -> str:
        depth = f" @{','.join(self.depth)}" if self.depth else ""
        return f"s{self.id}:{self.kind}({self.label}){depth}"


@dataclass(frozen=True)
class Prim:
    id: int
    kind: str
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    params: tuple[tuple[str, Any], ...] = ()
    label: str = ""
    lane: tuple[int, ...] = ()  # lane path when inside parallel lanes

    def param(self, name: str, default=None):
        for k, v in self.params:
            if k == name:
                return v
        return default

    def __str__(self) -> str:
        label = f"[{self.label}]" if self.label else ""
        lane = f" lane{'.'.join(map(str, self.lane))}" if self.lane else ""
        ins = ",".join(f"s{i}" for i in self.ins)
        outs = ",".join(f"s{i}" for i in self.outs)
        return f"p{self.id} {self.kind}{label}({ins}) -> {outs}{lane}"


@dataclass(frozen=True)
class Output:
    name: str
    stream: int  # the tensor stream the writer produces


@dataclass(frozen=True)
class Dataflow:
    """One region's dataflow graph: primitives in a topological order."""

    region: str
    order: tuple[str, ...]
    prims: tuple[Prim, ...]
    streams: tuple[StreamInfo, ...]
    outputs: tuple[Output, ...]
    extents: tuple[tuple[str, int], ...] = ()
    notes: tuple[str, ...] = field(default=(), compare=False)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.prims:
            out[p.kind] = out.get(p.kind, 0) + 1
        return out

    def __str__(self) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.counts().items()))
        return f"dataflow {self.region}: order {' '.join(self.order)}; {len(self.prims)} primitives ({kinds})"


class Builder:
    """Appends primitives and streams; memoises identical primitives on identical inputs, which
    is how one stream fans out to several consumers (the spec's broadcast)."""

    def __init__(self):
        self.prims: list[Prim] = []
        self.streams: list[StreamInfo] = []
        self.memo: dict = {}
        self.lane: tuple[int, ...] = ()

    def stream(self, kind: str, label: str, depth=()) -> int:
        sid = len(self.streams)
        self.streams.append(StreamInfo(sid, kind, label, tuple(depth)))
        return sid

    def add(self, kind: str, ins, out_kinds, params=(), label="", depth=(), out_labels=None) -> tuple[int, ...]:
        params = tuple(params)
        key = (kind, tuple(ins), params, () if kind in ("load", "root") else self.lane)
        if key in self.memo:
            return self.memo[key]
        labels = out_labels or [label] * len(out_kinds)
        outs = tuple(self.stream(k, lab, depth) for k, lab in zip(out_kinds, labels))
        self.prims.append(Prim(len(self.prims), kind, tuple(ins), outs, params, label, self.lane))
        self.memo[key] = outs
        return outs

    def one(self, *args, **kwargs) -> int:
        return self.add(*args, **kwargs)[0]
