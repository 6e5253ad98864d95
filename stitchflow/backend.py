"""The `torch.compile(model, backend="stitchflow")` backend.

Dynamo hands us an FX graph. Nodes with a lowering are grouped into partitions by data dependence
(torch.fx's CapabilityBasedPartitioner; program order where the graph writes in place or draws
random numbers); each partition becomes a submodule that, on its first call,
captures itself on the real arguments and runs through a stitchflow Program from then on.
Everything else runs eagerly, and every fallback is recorded with its reason: set
STITCHFLOW_LOGS=1 (or configure the "stitchflow" logger) to see them as they happen, or call
`stitchflow.backend.fallback_report()`.

Where autograd records (grad mode on and an input that requires grad, e.g. a parameter),
AOTAutograd splits the graph into a forward and a backward graph of ATen ops, both partitioned
and compiled the same way (training.py): the backward's reductions and elementwise work (norm and
activation gradients, bias gradients) are stitched like any other region. Where AOTAutograd
cannot trace the graph, or with options={"training": "recompute"}, a partition's forward still
runs through its program and the backward differentiates the partition's FX graph run again
eagerly (_RecomputedBackward).

Options (torch.compile(..., options={...})): target ("reference" | "gpu"; default "gpu" for
CUDA tensors, else "reference"), fusion (default "auto"), training ("compiled" | "recompute"),
max_programs (per partition, one per input signature; default 16, later signatures run eagerly),
and the programs' cuda_graphs, autotune and check_kernels (every generated kernel's call checked
against the reference interpreter: targets/gpu/check.py).

Dynamic shapes (dynamic=True, or Dynamo's automatic dynamic after a shape changes) need nothing more: a
partition captures itself on each call's real arguments, so each new shape is a program of its own.
"""

from __future__ import annotations

import logging
import operator
import os
from typing import Any

import torch
import torch.fx as fx

from .backend_layouts import (channels_last_order, convolution_inputs_like_gradients, convolution_positions,
                              free_positions, like_gradient, like_parameters,
                              pointwise_weight_gradient, restride_placeholders, restrided, saved_outputs_start,
                              saved_weights_channels_last, traced_layout, unfolded_weight_gradient, weight_like_gradient,
                              weights_channels_last)
from .backend_partition import (REFUSED, copied_graph, fuse_by_dependence, inline_empty_constants, outputs_read_eagerly,
                                fold_empty_values, refuse_vmap_bodies, run_flat, split_in_program_order,
                                supported)
from .backend_calls import (PartitionCall, address_of, bind_inputs, check_output_devices, dense_strides, numbers_of,
                            signature_of, static_address, traced_cuda_device, traced_on_host)
from .backend_vmap import functorch_transforms
from .frontend.capture import Captured, capture, reads_number
from .frontend.registry import LOWERINGS, describe_target, early_refusal, is_inplace, key_of
from .ir.errors import KernelMismatch, StitchflowError
from .planner.regions import regions_for
from .program import Program, gradients

log = logging.getLogger("stitchflow.backend")
if os.environ.get("STITCHFLOW_LOGS"):
    logging.basicConfig()
    logging.getLogger("stitchflow").setLevel(logging.DEBUG if os.environ["STITCHFLOW_LOGS"] == "debug" else logging.INFO)

FALLBACKS: list[str] = []  # every reason a piece of a model ran eagerly, in order
# calls that run eagerly by design and are not worth a record (torch's own usage logging, which transformers calls)
SILENT = frozenset({torch._C._log_api_usage_once})


def _record(reason: str) -> None:
    FALLBACKS.append(reason)
    log.info("stitchflow: runs eagerly: %s", reason)


def fallback_report() -> str:
    if not FALLBACKS:
        return "stitchflow: everything captured ran through stitchflow"
    return "stitchflow fell back to eager for:\n" + "\n".join(f"  - {r}" for r in FALLBACKS)


def _split_around(module: "StitchflowModule", refused: str, why: str) -> fx.GraphModule | None:
    """`module`'s graph with node `refused` left to eager and the other supported nodes partitioned again, each
    partition a StitchflowModule of its own (which may split further: every split leaves one node more to eager);
    None where no node was named or nothing would be left to compile."""
    gm = fx.GraphModule(module.gm, copied_graph(module.gm.graph))
    node = next((n for n in gm.graph.nodes if n.name == refused and n.op in ("call_function", "call_method")), None)
    if node is None:
        return None
    node.meta[REFUSED] = why
    # an eager write in place would reach only a partition's copy of what it writes (z[0].add_(1))
    if is_inplace(node) or not any(supported(n) for n in gm.graph.nodes) or _eager_write_through_an_alias(gm):
        return None
    split, names = fuse_by_dependence(gm) or split_in_program_order(gm)
    inline_empty_constants(split, names)
    for name in names:
        part = StitchflowModule(split.get_submodule(name), module.target, module.fusion, f"{module.name}.{name}")
        part.program_options, part.max_programs = module.program_options, module.max_programs
        setattr(split, name, part)
        COMPILED.append(part)
    for node in split.graph.nodes:
        if node.op == "call_module" and node.target in names:  # the partition's outputs are read as the graph's
            split.get_submodule(node.target).read_eagerly = outputs_read_eagerly(node, set(names), outputs_too=True)
    split.recompile()
    return split


def _fused_attention(node: fx.Node) -> bool:
    """An ATen op of torch's fused attention (flash, memory-efficient, cuDNN, CPU flash; forward or backward):
    what F.scaled_dot_product_attention becomes in an AOTAutograd graph, run by torch's kernels."""
    return node.op == "call_function" and str(node.target).startswith(("aten._scaled_dot_product_", "aten._flash_attention",
                                                                       "aten._efficient_attention"))


class StitchflowModule(torch.nn.Module):
    """One partition: compiled on first call for each input signature, eager if capture fails.

    Dynamo passes parameters and buffers as graph inputs. Those it marks as static addresses
    (nn.Module parameters and buffers) are bound into the program as parameters read in place,
    so that a call's CUDA-graph replay copies only the activations into its static inputs, not
    every weight (the Llama block's weights are 436 MB). Each call checks that those arguments
    are still the same storage; if one moved, the partition compiles again with it as an input.
    """

    def __init__(self, gm: fx.GraphModule, target: str | None, fusion, name: str):
        super().__init__()
        self.gm, self.target, self.fusion, self.name = gm, target, fusion, name
        self.programs: dict[tuple, Program | None] = {}
        self.bound: dict[tuple, dict[int, torch.Tensor]] = {}  # per signature: position -> bound tensor
        # per signature: position -> the bound tensor's address when bound (a parameter's `.data` may be
        # swapped afterwards, the object staying: vector_to_parameters, weight loading)
        self.addresses: dict[tuple, dict[int, tuple]] = {}
        self.moved: set[int] = set()  # positions whose storage changed between calls: inputs from now on
        self.last: PartitionCall | None = None  # the previous call, checked first (host time matters per call)
        # outputs that an eager op (or, in AOTAutograd's graphs, the other half) reads, by position
        # (None: the partition's single output); they leave in eager's strides (_eager_layouts)
        self.read_eagerly: frozenset = frozenset()
        # outputs whose readers take any layout (backend_layouts.py), by position: the program may
        # hand them over channels last
        self.free_outputs: frozenset = frozenset()
        # of those, the ones a convolution reads (a backward's gradients for cuDNN): stored channels last
        self.last_outputs: frozenset = frozenset()
        self.program_options: dict = {}  # the backend's options that programs take (cuda_graphs)
        self.max_programs = MAX_PROGRAMS  # signatures compiled; later ones run eagerly (options["max_programs"])
        self.strides: dict[tuple, list] = {}  # per signature: eager's output strides, None where not dense
        # per signature: where capture refused one node, the graph split around it (that node eager, the rest
        # partitions of their own), which runs instead of the whole graph eagerly
        self.split: dict[tuple, fx.GraphModule] = {}
        self.traced_strides: list | None = None  # per input: the strides the FX graph was traced with
        self.host_outputs: frozenset | None = None  # outputs eager made on the CPU, by position (traced_on_host)
        # inputs the graph reads as numbers (a norm's eps, an input under dynamic shapes): programs are per number
        self.numbers = tuple(k for k, n in enumerate(self._placeholders()) if reads_number(n))

    def _placeholders(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"]

    def forward(self, *args):
        return self._forward(self._call_for(args), args)

    def _call_for(self, args) -> "PartitionCall":
        call = self.last if self.last is not None and self.last.matches(args) else self._lookup(args)
        self.last = call
        return call

    def _forward(self, call: "PartitionCall", args):
        if call.program is None:
            return self._eager(args, self.split.get(call.key))
        if call.trusted:
            return self._run(call, args)
        try:  # the first run of a program: a failure here (a kernel that does not build) costs speed only
            out = self._run(call, args)
            check_output_devices(self.gm, out)
        except KernelMismatch:  # options["check_kernels"]: the user asked to be told
            raise
        except Exception as err:
            _record(f"{self.name}: its program failed on the first call, {type(err).__name__}: {err}")
            log.warning("stitchflow: %s runs eagerly: its program failed (%s: %s)", self.name, type(err).__name__, err)
            log.debug("stitchflow: %s failed here", self.name, exc_info=True)
            self.programs[call.key] = None
            self.last = None
            return self._eager(args)
        call.trusted = True
        return out

    def _eager(self, args, split: fx.GraphModule | None = None):
        return run_flat(split, self._as_traced(args)) if split is not None else self.gm(*self._as_traced(args))

    def split_or_run(self, args) -> tuple[fx.GraphModule | None, Any]:
        """For run_flat: (the graph split around a node that capture refused, None) where `args`' signature has
        one, for the caller to put its nodes in this partition's place; else (None, this partition's output).
        The signature is looked up once either way."""
        call = self._call_for(args)
        if call.program is None and (split := self.split.get(call.key)) is not None:
            return split, None
        return None, self._forward(call, args)

    def _as_traced(self, args) -> list:
        """The arguments, each tensor in the strides the FX graph was traced with: another partition may
        hand one over channels last (a free output; a convolution weight the forward stored so), and an
        eager op may refuse that layout (CUDA's native_group_norm takes only contiguous inputs), a view
        may not fit it, or a convolution follow it into its output's layout."""
        return [restrided(a, s) for a, s in zip(args, self.traced_layouts())]

    def traced_layouts(self) -> list:
        """Per input: the strides the FX graph was traced with (for symbolic ones, of a graph traced for dynamic
        shapes, the order of a dense layout's dims: backend_layouts.DenseOrder), or None (not a strided tensor)."""
        if self.traced_strides is None:
            self.traced_strides = [traced_layout(n.meta.get("val")) for n in self.gm.graph.nodes if n.op == "placeholder"]
        return self.traced_strides

    def _run(self, call: "PartitionCall", args):
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return self._to_host(_RecomputedBackward.apply(self, call, *args))
        out = call.program(*[args[k] for k in call.free])
        return self._to_host(self._eager_layouts(out, self.strides.get(call.key)) if self.read_eagerly else out)

    def _to_host(self, out):
        """`out` with the outputs eager made on the CPU moved there: a partition that makes CUDA tensors runs
        on the GPU whole, where a mask or a position list it also makes stayed on the CPU in eager (Starcoder2's
        sliding window), and the next graph was traced with it there."""
        if self.host_outputs is None:
            self.host_outputs = traced_on_host(self.gm)
        if not self.host_outputs:
            return out
        if isinstance(out, torch.Tensor):
            return out.cpu() if None in self.host_outputs else out
        return type(out)(o.cpu() if k in self.host_outputs and isinstance(o, torch.Tensor) else o
                         for k, o in enumerate(out))

    def _eager_layouts(self, out, strides):
        """`out` with the outputs that eager ops read in eager's strides: an ATen graph's next op
        was traced on them (a view of a permuted tensor, an attention kernel whose output layout
        follows its query's), where a program's outputs are contiguous."""
        if not strides:
            return out
        if isinstance(out, torch.Tensor):
            return restrided(out, strides[0]) if None in self.read_eagerly else out
        return type(out)(restrided(o, s) if k in self.read_eagerly else o for k, (o, s) in enumerate(zip(out, strides)))

    def _lookup(self, args) -> "PartitionCall":
        key = tuple(signature_of(a) for a in args) + numbers_of(args, self.numbers)
        moved = [k for k, address in self.addresses.get(key, {}).items() if address_of(args[k]) != address]
        if moved:
            self.moved.update(moved)
            del self.programs[key]
        if key not in self.programs and sum(p is not None for p in self.programs.values()) >= self.max_programs:
            _record(f"{self.name}: {self.max_programs} programs compiled, one per input signature (shapes change "
                    f"from call to call): calls of a new one run eagerly (options['max_programs'])")
            self.programs[key], self.bound[key], self.strides[key] = None, {}, []
        if key not in self.programs:
            self.programs[key], self.bound[key], self.strides[key] = self._compile(args)
            self.addresses[key] = {k: address_of(t) for k, t in self.bound[key].items()}
        return PartitionCall(self.programs[key], self.bound[key], args, key, self.numbers)

    def _compile(self, args) -> tuple[Program | None, dict, list]:
        device = traced_cuda_device(self.gm)
        target = self.target or ("gpu" if device is not None or any(isinstance(a, torch.Tensor) and a.is_cuda
                                                                    for a in args) else "reference")
        try:
            captured = self._capture(args)
            written = {k for k, _ in captured.input_writes}  # written back into the caller's tensor: not bound
            bound = {k: a for k, a in enumerate(args)
                     if k not in self.moved and k not in written and k not in self.numbers and static_address(a)}
            layouts = self._layout_options(captured, args, bound)
            examples = dict(zip(captured.graph.inputs, [a for a in args if isinstance(a, torch.Tensor)]))
            captured = bind_inputs(captured, args, bound)
            options = {**self.program_options, **layouts, **({"device": device} if device is not None else {})}
            prog = Program(captured, regions_for(captured.graph, self.fusion, target=target), target, self.fusion,
                           options, examples)
            log.info("stitchflow: %s compiled for %s: %d nodes in %d regions, %d inputs bound in place", self.name,
                     target, len(captured.graph.nodes), len(prog.regions), len(bound))
            return prog, bound, dense_strides(captured.example_outputs)
        except Exception as err:  # a bug of ours must cost speed, never the user's run
            known = isinstance(err, StitchflowError)
            why = str(err) if known else f"internal error, {type(err).__name__}: {err}"
            if not known:
                log.warning("stitchflow: %s: internal error (%s: %s)", self.name, type(err).__name__, err, exc_info=True)
            split = _split_around(self, getattr(err, "node", ""), why)
            if split is not None:
                self.split[tuple(signature_of(a) for a in args) + numbers_of(args, self.numbers)] = split
                why += f"; {err.node} runs eagerly, the rest of the partition compiles around it"
            _record(f"{self.name}: {why}")
            return None, {}, []

    def _capture(self, args) -> Captured:
        """The partition's graph lowered on its example values (the IR has no layouts; eager's example values do).
        An input it writes in place (a cache's copy_, x += 1) becomes a value the program copies back into the
        caller's tensor after each call, unless that input requires grad: autograd would not see the write, so
        the capture is redone to refuse it (and the partition splits around the write)."""
        traced = self._as_traced(args)
        captured = capture(self.gm, traced, input_writes=True)
        if any(isinstance(args[k], torch.Tensor) and args[k].requires_grad for k, _ in captured.input_writes):
            captured = capture(self.gm, traced)
        return captured

    def _layout_options(self, captured: Captured, args, bound: dict) -> dict:
        """The program's options on layouts at the partition's boundary: its free outputs by IR name, those
        of them a convolution reads (stored channels last; a view's as (name, shape)), and the inputs that
        arrive channels last (not bound ones: parameters keep their layout)."""
        leaves = captured.out_spec[1]

        def found(positions) -> list:
            return [leaves[0] if k is None else leaves[k] for k in positions
                    if (k is None and len(leaves) == 1) or (k is not None and k < len(leaves))]

        def node(leaf):  # a view leaf is (name, shape)
            return leaf if isinstance(leaf, str) else leaf[0] if isinstance(leaf, tuple) else None
        free = tuple(o for o in found(self.free_outputs) if isinstance(o, str))
        # a node is stored for its view only where no leaf outside the free ones returns it too
        held = {node(leaves[k]) for k in range(len(leaves)) if k not in self.free_outputs} if len(leaves) > 1 else set()
        last = tuple(o for o in found(self.last_outputs) if node(o) is not None and node(o) not in held)
        tensors = [(k, a) for k, a in enumerate(args) if isinstance(a, torch.Tensor)]
        orders = {name: channels_last_order(a) for (k, a), name in zip(tensors, captured.graph.inputs) if k not in bound}
        return {"free_outputs": free, "last_outputs": last,
                "input_orders": {name: p for name, p in orders.items() if p is not None}}

    @property
    def regions_executed(self) -> int:
        return sum(p.regions_executed for p in self.programs.values() if p is not None)


class _RecomputedBackward(torch.autograd.Function):
    """A partition called where autograd records: the forward runs through the stitchflow program
    (outputs the same as eager's, so inference without torch.no_grad keeps its speed), and the
    backward, if one comes, runs the partition's FX graph again eagerly and differentiates that.
    Gradients are eager's; training pays one eager forward more per partition."""

    @staticmethod
    def forward(ctx, module: "StitchflowModule", call: "PartitionCall", *args):
        ctx.module, ctx.n = module, len(args)
        ctx.tensor_at = [k for k, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = {k: a for k, a in enumerate(args) if not isinstance(a, torch.Tensor)}
        # inputs the program writes in place, as they came: the recomputation starts from them
        written = {call.free[k] for k, _ in call.program.captured.input_writes}
        ctx.save_for_backward(*(args[k].detach().clone() if k in written else args[k] for k in ctx.tensor_at))
        out = call.program(*[args[k] for k in call.free])
        ctx.single = isinstance(out, torch.Tensor)
        outs = (out,) if ctx.single else tuple(out)
        ctx.mark_non_differentiable(*(o for o in outs if isinstance(o, torch.Tensor) and not o.is_floating_point()))
        return out if ctx.single else outs

    @staticmethod
    def backward(ctx, *grads):
        args = [None] * ctx.n
        for k, a in ctx.others.items():
            args[k] = a
        for k, t in zip(ctx.tensor_at, ctx.saved_tensors):
            args[k] = t.detach().requires_grad_(t.requires_grad)
        with torch.enable_grad():
            out = ctx.module.gm(*args)
        outs = (out,) if ctx.single else tuple(out)
        wanted = [k for k in ctx.tensor_at if args[k].requires_grad]
        found = gradients(outs, grads, [args[k] for k in wanted])
        in_grads = dict(zip(wanted, found))
        return (None, None, *(in_grads.get(k) for k in range(ctx.n)))


def _eager_write_through_an_alias(gm: fx.GraphModule) -> str | None:
    """Why the graph must run eagerly as a whole, or None: an op that stays eager writes in place a tensor
    that another value of the graph aliases (y[0].zero_(), x[0].fill_(5), z = y.t(); z.zero_()). A
    partition hands over tensors of its own, not views of each other or of its inputs, so such a write
    would reach only its copy (judged on the example values' storages; AOTAutograd's graphs have no
    in-place ops)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def storage(node: fx.Node):
        value = node.meta.get("example_value", node.meta.get("val"))
        if not (isinstance(value, torch.Tensor) and value.layout == torch.strided):
            return None
        try:
            return StorageWeakRef(value.untyped_storage())
        except NotImplementedError:  # no storage of its own, e.g. a value batched inside torch.vmap's body
            return None

    storages = {n: storage(n) for n in gm.graph.nodes if n.op != "output"}
    for node in gm.graph.nodes:
        if not is_inplace(node) or supported(node) or not isinstance(node.args[0], fx.Node):
            continue
        written = storages.get(node.args[0])
        base = node.args[0]
        while is_inplace(base) and isinstance(base.args[0], fx.Node):  # y.mul_(2).zero_() writes y
            base = base.args[0]
        chain, todo = set(), [base]  # the tensor and the results of the in-place ops on it
        while todo:
            n = todo.pop()
            chain.add(n)
            todo += [u for u in n.users if is_inplace(u) and u.args[0] is n and u not in chain]
        if written is not None and any(ref is not None and ref == written for n, ref in storages.items() if n not in chain):
            return (f"{describe_target(node)} ({node.name}) runs eagerly and writes in place a tensor that another "
                    f"value of the graph aliases (a view): a partition's outputs are tensors of their own")
    return None


def stitchflow_backend(gm: fx.GraphModule, example_inputs: list[Any], options: dict | None = None, **kwargs):
    """Dynamo backend entry point (registered as "stitchflow" through torch_dynamo_backends).
    It never breaks the model: if partitioning itself fails, the whole graph runs eagerly."""
    options = dict(options or {}) | kwargs
    try:
        if records_gradients(example_inputs) and training_mode(options) == "compiled":
            from .training import compile_forward_and_backward
            compiled = compile_forward_and_backward(gm, example_inputs, options)
            if compiled is not None:
                return compiled
        transforms = functorch_transforms(gm)
        if transforms is not None:
            from .training import compile_through_functorch
            compiled = compile_through_functorch(gm, example_inputs, options, transforms)
            if compiled is not None:
                return compiled
        why = _eager_write_through_an_alias(gm)
        if why is not None:
            _record(f"whole graph ({len(gm.graph.nodes)} nodes): {why}")
            return gm.forward
        return _partition_and_wrap(gm, options)
    except torch._dynamo.exc.RestartAnalysis:  # Dynamo asks to trace again (dynamic shapes): its control flow
        raise
    except Exception as err:  # a bug or an FX corner case must cost speed, never the user's run
        _record(f"whole graph ({len(gm.graph.nodes)} nodes): {type(err).__name__}: {err}")
        return gm.forward


def records_gradients(example_inputs) -> bool:
    """Will autograd record through this graph: grad mode on, and an input (a parameter, say) requires grad."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


def training_mode(options: dict) -> str:
    mode = options.get("training", "compiled")
    if mode not in ("compiled", "recompute"):
        raise StitchflowError(f"options['training'] must be 'compiled' (forward and backward graphs through stitchflow) "
                              f"or 'recompute' (the backward differentiates an eager rerun), not {mode!r}")
    return mode


def _partition_and_wrap(gm: fx.GraphModule, options: dict, label: str = ""):
    """`gm` with every supported partition a StitchflowModule; `label` ("forward", "backward") names
    the graph in its partitions' names and in the fallback records."""
    target, fusion = options.get("target"), options.get("fusion", "auto")
    where = f"{label} graph: " if label else ""
    if label == "backward":  # saved activations may come channels last
        restride_placeholders(gm, lambda u: u.op == "output" or (u.op in ("call_function", "call_method")
                                                                 and not supported(u)))
        convolution_inputs_like_gradients(gm)
    saved_from = saved_outputs_start(label)
    if label == "forward" and _convolutions_channels_last(gm, target):
        saved_weights_channels_last(gm, saved_from)
    ours = (restrided, like_gradient, weight_like_gradient, weights_channels_last, pointwise_weight_gradient,
            unfolded_weight_gradient, like_parameters)
    refuse_vmap_bodies(gm)
    fold_empty_values(gm, saved_from)
    for node in gm.graph.nodes:
        if node.target is operator.getitem or node.target in ours:  # the op's record says why; ours
            continue
        if node.op in ("call_function", "call_method") and not supported(node):
            if node.target in SILENT:
                continue
            if _fused_attention(node):  # torch's own attention kernels, by design (training's attention rewrite)
                log.debug("%s%s (%s) runs torch's fused attention kernel", where, describe_target(node), node.name)
                continue
            why = node.meta.get(REFUSED) or (early_refusal(node) if key_of(node) in LOWERINGS else None)
            _record(f"{where}{describe_target(node)} ({node.name}): {why or 'no lowering to the IR'}")
        elif node.op == "call_module":
            _record(f"{where}module {node.target} ({node.name}): leaf modules are not captured")
    split, names = fuse_by_dependence(gm) or split_in_program_order(gm)
    inline_empty_constants(split, names)
    compiled = []
    for name in names:
        module = StitchflowModule(split.get_submodule(name), target, fusion, f"{label}.{name}" if label else name)
        setattr(split, name, module)
        compiled.append(module)
    for node in split.graph.nodes:
        if node.op == "call_module" and node.target in names:
            module = split.get_submodule(node.target)
            # an ATen graph's outputs are the other half's inputs, traced in eager's strides too
            module.free_outputs = free_positions(node, set(names), saved_from) if label else frozenset()
            module.last_outputs = convolution_positions(node) & module.free_outputs
            module.program_options = {k: options[k] for k in PROGRAM_OPTIONS if k in options}
            module.max_programs = int(options.get("max_programs", MAX_PROGRAMS))
            module.read_eagerly = outputs_read_eagerly(node, set(names), outputs_too=bool(label)) - module.free_outputs
    split.recompile()
    split.stitchflow_modules = compiled
    COMPILED.extend(compiled)
    return split


def _convolutions_channels_last(gm: fx.GraphModule, target: str | None) -> bool:
    """Will the graph's convolutions run channels last: the gpu target's programs store their
    activations so (targets/gpu/channels_last.py), and CUDA tensors go to it by default."""
    if target is not None:
        return target == "gpu"
    return any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.is_cuda
               for n in gm.graph.nodes if n.op == "placeholder")


PROGRAM_OPTIONS = ("cuda_graphs", "autotune", "check_kernels", "prefetch",  # backend options every partition's Program takes
                   "chains", "sibling_gemms", "unflatten_rows", "recognise_activations")
# programs a partition compiles, one per input signature: a model fed ever new shapes (a server's sequence lengths)
# would compile without end, so past this many, new signatures run eagerly (Dynamo's recompile limit is 8)
MAX_PROGRAMS = 16
COMPILED: list[StitchflowModule] = []  # every partition compiled since the last reset()


def regions_executed() -> int:
    """Regions run through stitchflow programs by every partition compiled since reset()."""
    return sum(m.regions_executed for m in COMPILED)


def reset() -> None:
    COMPILED.clear()
    FALLBACKS.clear()
