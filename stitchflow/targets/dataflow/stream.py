"""Token streams as whole numpy arrays (spec/dataflow.md, "Tokens and streams").

A stream is three parallel arrays: `kind` (ELEM for a coordinate, ref or value; STOP; DONE;
EMPTY for the empty token N), `ival` (the coordinate or ref of an ELEM, the level n of a stop
S(n)) and `fval` (the value of an ELEM in a value stream: a float, or a tile of shape `tile`).
Primitives are functions from whole streams to whole streams, so that the simulator (issue 4)
can add one timestamp array per stream without touching the functional code.

Structure. A stream of depth d is a flattened fibertree: every stop closes the innermost fiber
and n enclosing ones. The streams of one loop-nest position share their control tokens, and a
child stream (depth d+1) has exactly one stop per *unit* of its parent (depth d): a unit is an
element of the parent (its child fiber ends at that stop) or a stop of the parent that follows
no element (an empty parent fiber, which the scanner turns into a bare stop). `units` and
`unit_of` compute that correspondence with cumulative sums, which is what every vectorised
primitive below is built on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import kernels

ELEM, STOP, DONE, EMPTY = 0, 1, 2, 3


@dataclass(eq=False)
class Stream:
    kind: np.ndarray  # int8
    ival: np.ndarray  # int64
    fval: np.ndarray | None = None  # float64, shape (n,) or (n, *tile)

    def __len__(self) -> int:
        return len(self.kind)

    @property
    def is_value(self) -> bool:
        return self.fval is not None

    @property
    def n_elems(self) -> int:
        return int(np.count_nonzero(self.kind == ELEM))

    def __str__(self) -> str:
        return tokens_str(self)


def make(kind, ival=None, fval=None) -> Stream:
    kind = np.asarray(kind, dtype=np.int8)
    ival = np.zeros(len(kind), np.int64) if ival is None else np.asarray(ival, dtype=np.int64)
    return Stream(kind, ival, None if fval is None else np.asarray(fval, dtype=np.float64))


def root() -> Stream:
    """The ref stream `0 D` every scan starts from."""
    return make([ELEM, DONE], [0, 0])


def tokens_str(s: Stream, limit: int = 64) -> str:
    out = []
    for t in range(min(len(s), limit)):
        k = s.kind[t]
        if k == STOP:
            out.append(f"S{s.ival[t]}")
        elif k == DONE:
            out.append("D")
        elif k == EMPTY:
            out.append("N")
        elif s.fval is not None:
            v = s.fval[t]
            out.append(f"{float(v):g}" if np.ndim(v) == 0 else f"tile{tuple(np.shape(v))}")
        else:
            out.append(str(int(s.ival[t])))
    if len(s) > limit:
        out.append(f"... ({len(s)} tokens)")
    return " ".join(out)


def parse(text: str, values: bool = False) -> Stream:
    """Inverse of tokens_str for tests: '0 2 S0 S0 1 S1 D'."""
    kind, ival, fval = [], [], []
    for tok in text.split():
        if tok == "D":
            kind.append(DONE); ival.append(0); fval.append(0.0)
        elif tok == "N":
            kind.append(EMPTY); ival.append(0); fval.append(0.0)
        elif tok.startswith("S"):
            kind.append(STOP); ival.append(int(tok[1:])); fval.append(0.0)
        else:
            kind.append(ELEM)
            ival.append(0 if values else int(tok))
            fval.append(float(tok))
    return make(kind, ival, fval if values else None)


# ---------------------------------------------------------------- structure helpers

def is_item(s: Stream) -> np.ndarray:
    """Elements and empty tokens: the tokens that open a child fiber."""
    return (s.kind == ELEM) | (s.kind == EMPTY)


def units(s: Stream) -> np.ndarray:
    """Token indices of the units of `s`: items, and stops that follow no item."""
    return kernels.units(s.kind)


def unit_of(s: Stream) -> np.ndarray:
    """For each token of a child stream, the index of the parent unit it belongs to."""
    return kernels.unit_of(s.kind)


def item_ordinal(s: Stream) -> np.ndarray:
    """For each token, how many items precede it (the ordinal of an item)."""
    item = is_item(s).astype(np.int64)
    return np.cumsum(item) - item


def check_child(parent: Stream, child: Stream, what: str) -> np.ndarray:
    u = units(parent)
    n_stops = int(np.count_nonzero(child.kind == STOP))
    if n_stops != len(u):
        raise ValueError(f"{what}: child stream has {n_stops} stops for {len(u)} parent units")
    return u


def item_parent(parent: Stream, child: Stream, what: str = "stream") -> np.ndarray:
    """For each token of `child`, the parent token index of the fiber it lies in."""
    u = check_child(parent, child, what)
    uo = unit_of(child)
    uo = np.minimum(uo, max(len(u) - 1, 0))  # the trailing D belongs to no unit
    return u[uo] if len(u) else np.zeros(len(child), np.int64)


def merge_items(item_unit: np.ndarray, template: Stream, items: dict) -> Stream:
    """Build a child stream from sorted items (with the unit each belongs to) and the stops
    and done of `template` (a stream with the same structure). `items` has kind/ival/fval
    arrays for the items."""
    tmpl_stop = np.flatnonzero(template.kind != ELEM)
    tmpl_stop = tmpl_stop[template.kind[tmpl_stop] != EMPTY]
    stop_kind = template.kind[tmpl_stop]
    stop_ival = template.ival[tmpl_stop]
    n_items = len(item_unit)
    n_ctrl = len(tmpl_stop)
    k = np.arange(n_ctrl)
    # a control token k closes unit k (the final D closes nothing: it goes last)
    ctrl_pos = np.searchsorted(item_unit, k, side="right") + k
    item_pos = np.arange(n_items) + item_unit
    kind = np.empty(n_items + n_ctrl, np.int8)
    ival = np.empty(n_items + n_ctrl, np.int64)
    kind[item_pos], ival[item_pos] = items["kind"], items["ival"]
    kind[ctrl_pos], ival[ctrl_pos] = stop_kind, stop_ival
    fval = None
    if items.get("fval") is not None:
        f = items["fval"]
        fval = np.zeros((n_items + n_ctrl,) + f.shape[1:], np.float64)
        fval[item_pos] = f
    return Stream(kind, ival, fval)


def ancestors(chain: list[Stream]) -> list[np.ndarray]:
    """chain[0] is a parent stream, chain[m+1] a child of chain[m]. For the items of the last
    stream, the token index of their ancestor in every stream of the chain (last = itself)."""
    last = chain[-1]
    idx = np.flatnonzero(is_item(last))
    out = [idx]
    for parent, child in zip(reversed(chain[:-1]), reversed(chain[1:])):
        idx = item_parent(parent, child)[idx]
        out.append(idx)
    return out[::-1]


def empty_like_values(s: Stream, tile=()) -> np.ndarray:
    return np.zeros((len(s),) + tuple(tile), np.float64)
