"""stitchflow: a fusion-centric compiler for sparse and dense deep learning."""

from .ir.errors import FormatError, KernelMismatch, ShapeError, StitchflowError, TargetError, UnsupportedOpError
from .program import Program, compile

__version__ = "0.1.0"


def _register_dynamo_backend() -> None:
    """Make backend="stitchflow" work on import too, where the package is not pip-installed
    (the torch_dynamo_backends entry point covers installed copies)."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if "stitchflow" not in _COMPILER_FNS:

        def stitchflow(gm, example_inputs, **kwargs):
            from .backend import stitchflow_backend

            return stitchflow_backend(gm, example_inputs, **kwargs)

        register_backend(stitchflow, name="stitchflow")


_register_dynamo_backend()
__all__ = [
    "compile", "Program", "StitchflowError", "UnsupportedOpError", "ShapeError", "FormatError", "TargetError",
    "KernelMismatch",
]
