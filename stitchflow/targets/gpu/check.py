"""options["check_kernels"]: a generated kernel's outputs checked against the reference interpreter.

For finding a miscompile: the max-pool gradient of scripts/triton_div_probe.py (a masked load that
Triton 3.6 read with its neighbour's mask) was found so, and scripts/kernel_check_probe.py runs the
zoo this way. Every checked call runs the kernel's nodes twice more through torch (in the outputs'
dtypes and in float64), so checked calls are slow.
"""

from __future__ import annotations

import dataclasses

import torch

from ...ir.errors import KernelMismatch
from ...ir.interpret import eval_node
from .scatter_stores import part_nodes, stored

# an output's error against a float64 evaluation may be this many times the reference
# interpreter's own (in the output's dtype), plus this share of the output's largest magnitude
CHECK_RATIO, CHECK_FLOOR = 4.0, {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}


def _reference(kernel, env, wide: bool) -> dict:
    """The kernel's nodes evaluated by the reference interpreter from `env`'s inputs (and the
    producers a kernel inlines that nobody stored); `wide`: floating tensors in float64."""
    graph, ours = kernel.graph, {n.name for p in kernel.plans for n in part_nodes(p)}
    ref = {name: (value.double() if wide and isinstance(value, torch.Tensor) and value.is_floating_point() else value)
           for name, value in env.items() if name not in ours}

    def evaluate(name: str) -> None:
        if name not in ref:
            node = graph.node_of[name]
            for t in node.inputs:
                evaluate(t)
            out_type = graph.type_of[name]
            if wide and out_type.dtype.is_floating_point:
                out_type = dataclasses.replace(out_type, dtype=torch.float64)
            ref[name] = eval_node(node, ref, out_type)
    for name in ours:
        evaluate(name)
    return ref


def check_outputs(kernel, launch, env) -> None:
    """options["check_kernels"] (or STITCHFLOW_CHECK_KERNELS=1): a call's outputs against the reference
    interpreter's evaluation of the same nodes on the same inputs. A floating output may be off a
    float64 evaluation by CHECK_RATIO times the interpreter's own error in the output's dtype (so
    rounding noise, as in a sum that cancels to nearly zero, is not flagged), plus CHECK_FLOOR of its
    largest magnitude; NaNs must match; other dtypes must be equal. KernelMismatch names the kernel,
    the output and its error, with the kernel's source attached. For finding a miscompile (the
    max-pool gradient of scripts/triton_div_probe.py was found so); every node runs twice more through
    torch, so checked calls are slow."""
    ref, truth = _reference(kernel, env, wide=False), None
    for plan in kernel.plans:
        for name in stored(plan):
            got, want = env[name], ref[name]
            if not want.dtype.is_floating_point:
                if not torch.equal(got, want):
                    raise _mismatch(kernel, launch, name, want.dtype, f"{int((got != want).sum())} elements")
                continue
            truth = truth or _reference(kernel, env, wide=True)
            exact = truth[name]
            if not torch.equal(got.isnan(), want.isnan()):
                raise _mismatch(kernel, launch, name, want.dtype, "NaN where the interpreter has none, or none "
                                "where it has one")
            finite = ~want.isnan()
            if not finite.any():
                continue
            error = (got[finite].double() - exact[finite]).abs().max().item()
            own = (want[finite].double() - exact[finite]).abs().max().item()
            scale = exact[finite].abs().max().item()
            if error > CHECK_RATIO * own + CHECK_FLOOR.get(want.dtype, 0.0) * scale:
                raise _mismatch(kernel, launch, name, want.dtype, f"{error:.3g} against float64, where the "
                                f"interpreter's is {own:.3g} (largest magnitude {scale:.3g})")


def _mismatch(kernel, launch, name: str, dtype, how: str) -> KernelMismatch:
    config = kernel.chosen[0] if kernel.chosen and len(kernel.chosen) == 1 else kernel.chosen
    return KernelMismatch(f"kernel {kernel.title} ({launch.spec.name}): output {name} ({dtype}) differs from the "
                          f"reference interpreter: {how}; config {config}", launch.spec.source)
