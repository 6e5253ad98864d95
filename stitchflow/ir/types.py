"""Tensor types: shape, dtype and storage format (fibertree levels).

A format gives one level kind per stored mode, the order in which modes are stored, and an
optional block shape (a block-sparse tensor stores dense tiles as its values). This is the
vocabulary of the Sparse Abstract Machine (spec/dataflow.md) and of TACO.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .errors import FormatError


class Level(enum.Enum):
    DENSE = "d"
    COMPRESSED = "c"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Format:
    """Storage of a tensor: `levels[k]` is the kind of the k-th *stored* level, which holds
    mode `mode_order[k]`. `block` is the tile shape when values are dense tiles."""

    levels: tuple[Level, ...]
    mode_order: tuple[int, ...]
    block: tuple[int, ...] | None = None

    def __post_init__(self):
        if sorted(self.mode_order) != list(range(len(self.levels))):
            raise FormatError(f"mode order {self.mode_order} is not a permutation of {len(self.levels)} modes")
        if self.block is not None and len(self.block) != len(self.levels):
            raise FormatError(f"block shape {self.block} has the wrong rank for {len(self.levels)} modes")

    @property
    def rank(self) -> int:
        return len(self.levels)

    @property
    def is_dense(self) -> bool:
        return all(lv is Level.DENSE for lv in self.levels) and self.block is None

    @property
    def is_sparse(self) -> bool:
        return not self.is_dense

    def level_of_mode(self, mode: int) -> Level:
        return self.levels[self.mode_order.index(mode)]

    def __str__(self) -> str:
        name = _NAME_OF.get((self.levels, self.mode_order))
        text = name or "(" + ",".join(str(lv) for lv in self.levels) + ")"
        if self.mode_order != tuple(range(self.rank)) and name is None:
            text += "@" + "".join(str(m) for m in self.mode_order)
        if self.block is not None:
            square = self.block[0] if len(set(self.block)) == 1 else "x".join(map(str, self.block))
            text = f"bsr{square}" if text == "csr" else f"b{text}[{'x'.join(map(str, self.block))}]"
        return text


def dense(rank: int) -> Format:
    return Format((Level.DENSE,) * rank, tuple(range(rank)))


_D, _C = Level.DENSE, Level.COMPRESSED
_NAMED: dict[str, Format] = {
    "csr": Format((_D, _C), (0, 1)),
    "csc": Format((_D, _C), (1, 0)),
    "dcsr": Format((_C, _C), (0, 1)),
    "dcsc": Format((_C, _C), (1, 0)),
    "coo": Format((_C, _C), (0, 1)),  # stored as DCSR: coordinates sorted row-major, unique
}
_NAME_OF = {(f.levels, f.mode_order): n for n, f in _NAMED.items() if n != "coo"}
_NAME_OF[((_D, _D), (0, 1))] = "dense"
_NAME_OF[((_D,), (0,))] = "dense"

FORMAT_NAMES = ("dense", "csr", "csc", "dcsr", "dcsc", "coo", "bsr<B>", "bsr<B>x<C>", "(d,c,...)[@order]")


def parse_format(spec: str | Format, rank: int, block: tuple[int, ...] | None = None) -> Format:
    """Parse a format name: 'dense', 'csr', 'csc', 'dcsr', 'dcsc', 'coo', 'bsr' (needs `block`),
    or a level string such as 'dc', 'ccd' with an optional '@' mode order ('cc@10')."""
    if isinstance(spec, Format):
        if spec.rank != rank:
            raise FormatError(f"format {spec} has {spec.rank} levels but the tensor has {rank} modes")
        return spec
    text = spec.strip().lower()
    if text == "dense":
        return dense(rank)
    if text.startswith("bsr"):  # bsr needs a block: from the tensor, or in the name (bsr16, bsr16x32)
        sizes = text[3:].split("x") if text[3:] else []
        if sizes and not all(s.isdigit() for s in sizes):
            raise FormatError(f"unknown format name {spec!r}; a block format reads like bsr16 or bsr16x32")
        if sizes:
            block = (int(sizes[0]), int(sizes[-1]))
        if block is None:
            raise FormatError("format 'bsr' needs a block shape: name it as bsr16 or bsr16x32")
        return Format((_D, _C), (0, 1), tuple(block))
    if text in _NAMED:
        fmt = _NAMED[text]
    else:
        fmt = _parse_levels(text)
    if fmt.rank != rank:
        raise FormatError(f"format {spec!r} has {fmt.rank} levels but the tensor has {rank} modes")
    return Format(fmt.levels, fmt.mode_order, tuple(block) if block else None)


def _parse_levels(text: str) -> Format:
    body, _, order = text.strip("()").partition("@")
    letters = body.replace(",", "")
    if not letters or any(ch not in "dc" for ch in letters):
        raise FormatError(f"unknown format name {text!r}; known: {', '.join(FORMAT_NAMES)}")
    levels = tuple(Level(ch) for ch in letters)
    mode_order = tuple(int(ch) for ch in order) if order else tuple(range(len(levels)))
    return Format(levels, mode_order)


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: torch.dtype
    format: Format

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        fmt = "" if self.format.is_dense else f" {self.format}"
        return f"{dt}[{','.join(map(str, self.shape))}]{fmt}"


LOW_PRECISION = (torch.float16, torch.bfloat16)  # float dtypes computed in float32 and rounded on store


def dense_type(shape, dtype: torch.dtype) -> TensorType:
    shape = tuple(int(s) for s in shape)
    return TensorType(shape, dtype, dense(len(shape)))


def format_of_tensor(t: torch.Tensor) -> Format:
    """The format that matches how a torch tensor is stored."""
    layout = t.layout
    if layout == torch.strided:
        return dense(t.dim())
    if t.dim() != 2:
        raise FormatError(f"sparse tensors of rank {t.dim()} are not supported (only matrices)")
    if layout == torch.sparse_csr:
        return _NAMED["csr"]
    if layout == torch.sparse_csc:
        return _NAMED["csc"]
    if layout == torch.sparse_coo:
        return _NAMED["coo"]
    if layout == torch.sparse_bsr:
        return Format((_D, _C), (0, 1), tuple(t.values().shape[-2:]))
    if layout == torch.sparse_bsc:
        return Format((_D, _C), (1, 0), tuple(t.values().shape[-2:]))
    raise FormatError(f"tensor layout {layout} is not supported")


def type_of_tensor(t: torch.Tensor) -> TensorType:
    return TensorType(tuple(t.shape), t.dtype, format_of_tensor(t))
