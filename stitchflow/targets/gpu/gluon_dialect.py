"""Generated Triton source -> Gluon source, for kernels that need what only Gluon exposes (TMA
copies into shared memory that stay in flight across other work: codegen_tma).

The generated code tiles every part as [BP, BL] (or [BP, split]) with 1-D aranges expanded on
one axis, reductions that keep their dims, and scalars; so one blocked layout, `LAYOUT`, and its
slices type every tensor. The translation is mechanical: aranges and fills get that layout, the
block barrier is Gluon's `thread_barrier`, and every other `tl.` name maps to the `gl.` name of
the same meaning. A name Gluon lacks is refused with `GluonRefusal` (the autotuner then skips
the config) rather than guessed at."""

from __future__ import annotations

import re

GLUON_HEADER = '''import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

LAYOUT = gl.constexpr({layout})


@gluon.jit
def _broadcast_to(x, shape: gl.constexpr):
    return x + gl.zeros(shape, x.dtype, layout=LAYOUT)
'''

TRITON_IMPORTS = ("import triton\nimport triton.language as tl\n"
                  "from triton.language.extra import libdevice  # noqa: F401\n")

RENAMED = {"debug_barrier": "thread_barrier"}
KEPT = {"PropagateNan"}  # Triton's own enums, which Gluon's functions take as they are


class GluonRefusal(ValueError):
    """The generated code uses something this translation does not map to Gluon."""


def blocked_layout(bp: int, num_warps: int, elem_bytes: int, p_contiguous: bool = True) -> str:
    """The layout of [BP, BL] tiles: 16-byte vectors along the axis contiguous in memory. Axis 0
    (the parallel points, as in column blocks): the rest of a warp and the warps along the local
    axis; axis 1 (rows): a warp's lanes and the warps along the row."""
    vec = max(1, 16 // elem_bytes)
    if not p_contiguous:
        return (f"gl.BlockedLayout(size_per_thread=[1, {vec}], threads_per_warp=[1, 32], "
                f"warps_per_cta=[1, {num_warps}], order=[1, 0])")
    vec = min(bp, vec)
    lanes_p = max(1, min(32, bp // vec))
    return (f"gl.BlockedLayout(size_per_thread=[{vec}, 1], threads_per_warp=[{lanes_p}, {32 // lanes_p}], "
            f"warps_per_cta=[1, {num_warps}], order=[0, 1])")


def to_gluon(source: str, layout: str) -> str:
    """The Gluon module for generated Triton `source` (codegen_header.HEADER, parts, dispatch)."""
    if TRITON_IMPORTS not in source:
        raise GluonRefusal("not a generated kernel module (its imports differ)")
    if "libdevice." in source.replace(TRITON_IMPORTS, ""):
        raise GluonRefusal("libdevice calls have no Gluon counterpart here")
    out = source.replace(TRITON_IMPORTS, GLUON_HEADER.format(layout=layout))
    out = out.replace("@triton.jit", "@gluon.jit")
    out = re.sub(r"tl\.arange\(0, (\w+)\)\[:, None\]", r"gl.arange(0, \1, layout=gl.SliceLayout(1, LAYOUT))[:, None]",
                 out)
    out = re.sub(r"tl\.arange\(0, (\w+)\)\[None, :\]", r"gl.arange(0, \1, layout=gl.SliceLayout(0, LAYOUT))[None, :]",
                 out)
    out = re.sub(r"tl\.full\((\[[^\]]*\]), ([^,()]+), (tl\.\w+)\)", r"gl.full(\1, \2, \3, layout=LAYOUT)", out)
    out = out.replace("tl.broadcast_to(", "_broadcast_to(")
    for bare in ("tl.arange(", "tl.full("):
        if bare in out:
            raise GluonRefusal(f"{bare[:-1]} in a shape the translation does not lay out")
    return re.sub(r"\btl\.(\w+)", _gl_name, out)


def _gl_name(match: re.Match) -> str:
    from triton.experimental.gluon import language as gl

    if match.group(1) in KEPT:
        return match.group(0)
    name = RENAMED.get(match.group(1), match.group(1))
    if not hasattr(gl, name):
        raise GluonRefusal(f"tl.{match.group(1)} has no Gluon counterpart")
    return f"gl.{name}"
