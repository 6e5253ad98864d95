"""stitchflow: a fusion-centric compiler for sparse and dense deep learning."""

from .ir.errors import FormatError, ShapeError, StitchflowError, TargetError, UnsupportedOpError
from .program import Program, compile

__version__ = "0.1.0"
__all__ = [
    "compile", "Program", "StitchflowError", "UnsupportedOpError", "ShapeError", "FormatError", "TargetError",
]
