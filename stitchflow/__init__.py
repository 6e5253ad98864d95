"""stitchflow: a fusion-centric compiler for sparse and dense deep learning."""

from .ir.errors import FormatError, KernelMismatch, ShapeError, StitchflowError, TargetError, UnsupportedOpError
from .program import Program, compile

__version__ = "0.1.0"


def _register_dynamo_backend() -> None:
    """Make backend="stitchflow" work on import too, where the package is not pip-installed.

    An installed copy registers through its torch_dynamo_backends entry point, which torch loads on
    the first lookup of the name, after importing this package: registering here as well would make
    that lookup fail with torch's "duplicate name" assertion."""
    from importlib.metadata import entry_points

    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if any(ep.name == "stitchflow" for ep in entry_points(group="torch_dynamo_backends")):
        return
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
