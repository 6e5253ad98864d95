"""What a partition's call runs on (backend.StitchflowModule): the signature that picks its program, the
arguments bound into the program in place (parameters at fixed addresses), and the devices its values were traced
on and must come out on."""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .frontend.capture import Captured
from .ir.errors import StitchflowError
from .program import Program


class PartitionCall:
    """What a call with the same signature and bound storage as an earlier one runs: checking
    that costs a pointer per bound tensor and a signature per activation, where the full
    signature of every argument costs more host time than a small block's kernels."""

    def __init__(self, program: Program | None, bound: dict, args, key: tuple = (), numbers: tuple = ()):
        self.program, self.n, self.key, self.numbers = program, len(args), key, numbers
        self.values = numbers_of(args, numbers)
        self.trusted = False  # set once the program has run: later calls skip the fallback's guard
        self.free = tuple(k for k in range(len(args)) if k not in bound)
        self.pointers = tuple((k, t.data_ptr()) for k, t in bound.items())
        self.signature = tuple((k, signature_of(args[k])) for k in self.free)

    def matches(self, args) -> bool:
        return (len(args) == self.n and all(isinstance(args[k], torch.Tensor) and args[k].data_ptr() == p for k, p in self.pointers)
                and all(signature_of(args[k]) == s for k, s in self.signature)
                and (not self.numbers or numbers_of(args, self.numbers) == self.values))


def numbers_of(args, positions: tuple) -> tuple:
    """The numbers of the inputs at `positions` (read by item() in the graph), for a program's key."""
    return tuple(args[k].item() if isinstance(args[k], torch.Tensor) else args[k] for k in positions)


def traced_cuda_device(gm: fx.GraphModule) -> torch.device | None:
    """The CUDA device the graph's traced values live on, if any. A partition may take no CUDA input and still
    make CUDA tensors: BART's attention mask, made of aranges on the device and nothing else. Judged by its
    inputs alone, it ran on the reference target, on the CPU, and the next graph met the mask there."""
    for node in gm.graph.nodes:
        value = node.meta.get("val", node.meta.get("example_value"))
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            return value.device
    return None


def traced_on_host(gm: fx.GraphModule) -> frozenset:
    """Positions of the outputs traced on the CPU (None: the single output) in a graph that also makes CUDA
    tensors; empty where it makes none."""
    if traced_cuda_device(gm) is None:
        return frozenset()
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]

    def on_host(n) -> bool:
        value = n.meta.get("val", n.meta.get("example_value")) if isinstance(n, fx.Node) else None
        return isinstance(value, torch.Tensor) and value.device.type == "cpu"

    if isinstance(outputs, (tuple, list)):
        return frozenset(k for k, n in enumerate(outputs) if on_host(n))
    return frozenset({None}) if on_host(outputs) else frozenset()


def check_output_devices(gm: fx.GraphModule, out) -> None:
    """Raise if a program's output is not on the device its traced value was on. The next graph was traced
    with eager's devices and would fail there, far from the cause (a factory op placed on the wrong device)."""
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    traced = [n.meta.get("val", n.meta.get("example_value")) if isinstance(n, fx.Node) else None
              for n in (outputs if isinstance(outputs, (tuple, list)) else [outputs])]
    got = [out] if isinstance(out, torch.Tensor) else list(out) if isinstance(out, (tuple, list)) else []
    if len(got) != len(traced):
        return
    for k, (want, have) in enumerate(zip(traced, got)):
        if isinstance(want, torch.Tensor) and isinstance(have, torch.Tensor) and want.device.type != have.device.type:
            raise StitchflowError(f"output {k} came out on {have.device}, traced on {want.device}")


def signature_of(a):
    if isinstance(a, torch.Tensor):
        return tuple(a.shape), a.stride(), a.dtype, a.layout, a.device.type
    if isinstance(a, (tuple, list)):
        return type(a), tuple(signature_of(x) for x in a)
    return a


def static_address(a) -> bool:
    """A floating-point parameter or buffer that Dynamo marks as living at a fixed address
    (integer buffers stay inputs: the gpu target folds constant aranges, which a later
    in-place update of a bound buffer would not see)."""
    if not isinstance(a, torch.Tensor) or not a.is_floating_point() or a.layout != torch.strided:
        return False
    return isinstance(a, torch.nn.Parameter) or getattr(a, "_dynamo_static_input_type", None) is not None


def dense_strides(outputs) -> list:
    """The strides of a partition's example outputs (flat), None where one is not a dense tensor."""
    flat = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs) if isinstance(outputs, (tuple, list)) else []
    return [o.stride() if isinstance(o, torch.Tensor) and o.layout == torch.strided and is_dense(o) else None for o in flat]


def is_dense(t: torch.Tensor) -> bool:
    """Its elements fill a block of memory once each, in some order of the dims (no expand, no gaps)."""
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def address_of(a) -> tuple | None:
    """Where a bound tensor's values live, and how they are laid out there."""
    if not isinstance(a, torch.Tensor):
        return None
    return a.data_ptr(), tuple(a.shape), a.stride(), a.dtype


def bind_inputs(captured: Captured, args, bound: dict) -> Captured:
    """The captured graph with the inputs at the `bound` positions turned into parameters
    holding those tensors (by reference: the program reads their storage when it runs)."""
    if not bound:
        return captured
    tensor_names = iter(captured.graph.inputs)
    moved = {}
    for k, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            name = next(tensor_names)
            if k in bound:
                moved[name] = bound[k].detach()
    graph = dataclasses.replace(captured.graph, inputs=tuple(n for n in captured.graph.inputs if n not in moved),
                                params=captured.graph.params + tuple(moved))
    names = tuple(n for k, n in enumerate(captured.input_names) if k not in bound)
    free = [k for k in range(len(args)) if k not in bound]  # the program's inputs: the arguments left
    writes = tuple((free.index(k), name) for k, name in captured.input_writes)
    numbers = tuple((free.index(k), number) for k, number in captured.valued_inputs)  # (never bound)
    return dataclasses.replace(captured, graph=graph, param_values={**captured.param_values, **moved},
                               input_names=names, input_writes=writes, valued_inputs=numbers)
