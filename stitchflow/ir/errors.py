"""Errors that name the problem: every refusal says what was wrong and where."""


class StitchflowError(Exception):
    """Base class of every error stitchflow raises on purpose."""

    node: str = ""  # the FX node it concerns, where one does (capture names it, so the backend can split around it)


class UnsupportedOpError(StitchflowError):
    """An operator (or an operator with these arguments) has no lowering to the IR."""

    def __init__(self, op: str, reason: str = "", node: str = ""):
        self.op, self.reason, self.node = op, reason, node
        where = f" at node {node!r}" if node else ""
        why = f": {reason}" if reason else ""
        super().__init__(f"unsupported op {op}{where}{why}")


class ShapeError(StitchflowError):
    """Operands whose shapes do not fit together."""


class FormatError(StitchflowError):
    """An unknown format name, or a format that does not fit a tensor."""


class TargetError(StitchflowError):
    """A target cannot run a region (the message says why)."""


class KernelMismatch(TargetError):
    """A generated kernel's output differs from the reference interpreter's (options["check_kernels"]);
    `source` is the kernel's source."""

    def __init__(self, message: str, source: str = ""):
        super().__init__(message)
        self.source = source
