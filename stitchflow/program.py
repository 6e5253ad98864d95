"""`stitchflow.compile`: capture a model, choose fusion regions, compile them for a target.

    prog = stitchflow.compile(model, (A, X), target="reference", fusion="partial")
    y = prog(A, X)            # runs the regions
    prog.regions              # the fusion regions
    print(prog.explain())     # why each pair of neighbouring ops is or is not fused
"""

from __future__ import annotations

import inspect
import logging
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .frontend.capture import Captured, capture, inverse_permutation, rebuild_outputs, symbolic_trace
from .ir.errors import ShapeError, StitchflowError, UnsupportedOpError
from .ir.graph import Graph, Region
from .planner.regions import regions_for
from .replay import GraphReplay
from .targets import get_target

log = logging.getLogger("stitchflow")


class Program:
    def __init__(self, captured: Captured, regions: Sequence[Region], target: str, fusion, options=None,
                 examples: Mapping[str, Any] | None = None):
        """`examples`: example inputs by IR name, for a target's static estimates (the dataflow target's order
        search counts their non-zeros); the compiled program does not keep them."""
        self.target = get_target(target)
        self.options = dict(options or {})
        if hasattr(self.target, "prepare"):  # a target's own rewrite of the graph before its regions compile
            captured, regions = self.target.prepare(captured, regions, self.options)
        self.captured = captured
        self.regions = tuple(regions)
        self.target_name = target
        self.fusion = fusion
        self.regions_executed = 0  # counts region runs: proof that calls go through our code
        self.plan_values: dict | None = None  # the tensors the planner measured densities on
        # the captured model or function: where autograd records, a backward differentiates it run
        # again eagerly (stitchflow.compile sets it; the torch.compile backend recomputes its own)
        self.reference = None
        self.signature: CallSignature | None = None  # keyword inputs (stitchflow.compile's example_kwargs)
        self._parameters: list | None = None  # the reference's parameters (grad_params)
        self._prefetched = False  # whether the target's prefetch ran (before the first call's regions)
        self._scalar_moves: tuple | None = None  # (device, names): see _scalars_to_device
        refusals = [(r, self.target.check_region(self.graph, r)) for r in self.regions]
        bad = [(r, why) for r, why in refusals if why]
        if bad:
            r, why = bad[0]
            raise StitchflowError(f"target {target!r} cannot run region {r.name}: {why}")
        self._compiled = [self.target.compile_region(self.graph, r, captured.param_values, self.options, examples)
                          for r in self.regions]
        use_graphs = self.options.get("cuda_graphs", target == "gpu")
        if use_graphs not in (True, False, "always"):
            raise StitchflowError(f"options['cuda_graphs'] must be True (replay where a replay is faster), False or "
                                  f"'always' (replay even where it is slower), not {use_graphs!r}")
        # the target's trailing steps that a replay would only have to clone out of its buffers
        split = getattr(self.target, "graph_tail", None) if use_graphs else None
        head, tail = split(self.graph, self._compiled) if split is not None else (self._compiled, None)
        self._replay = GraphReplay(lambda inputs: self._run(self._bind(inputs), head), self.graph.outputs,
                                   self.options.get("free_outputs", ()), self.graph.inputs,
                                   keep_always=use_graphs == "always", on_replay=self._replayed,
                                   tail=tail) if use_graphs else None

    @property
    def graph(self) -> Graph:
        return self.captured.graph

    @property
    def compiled(self) -> tuple:
        """The target's runner for each region, in region order (targets attach what they
        built to it: dataflow graphs, kernels, token counts)."""
        return tuple(self._compiled)

    def __call__(self, *inputs, **kwargs):
        if self.signature is not None:
            inputs = self.signature.flatten(inputs, kwargs)
        elif kwargs:
            raise StitchflowError(f"the program takes positional inputs only, called with keywords {', '.join(kwargs)} "
                                  "(stitchflow.compile(..., example_kwargs=...) compiles a keyword call)")
        if self.reference is not None and torch.is_grad_enabled():
            needs = self.grad_params() + [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
            if needs and self.captured.random_seed is not None:
                raise StitchflowError("the program draws random numbers (dropout in training), so its gradient "
                                      "cannot come from rerunning the model eagerly, which draws others: train "
                                      "through torch.compile(model, backend='stitchflow'), or call under no_grad")
            if needs:
                return _with_recomputed_backward(self, inputs, needs)
        return self._forward(inputs)

    def _forward(self, inputs):
        if self.captured.valued_inputs:
            self._check_numbers(inputs)
        if self.captured.random_seed is not None:
            inputs = (*inputs, self.random_seed(inputs))
        if self._replay is not None and self._replay.applies(inputs):
            env = self._replay(inputs)
        else:
            env = self._run(self._bind(inputs))
        self._write_inputs(inputs, env)
        return self.outputs_of(env)

    def random_seed(self, inputs) -> torch.Tensor:
        """A fresh seed for the program's random numbers, from torch's generator of the device the program runs on
        (torch.manual_seed makes a run repeatable; under a CUDA graph's capture, torch advances it per replay)."""
        device = next((x.device for x in inputs if isinstance(x, torch.Tensor) and x.is_cuda), None) or \
            self.options.get("device") or (torch.device("cuda") if self.target_name == "gpu" and
                                           torch.cuda.is_available() else torch.device("cpu"))
        return torch.randint(0, 1 << 62, (), dtype=torch.int64, device=device)

    def _check_numbers(self, inputs) -> None:
        """The inputs whose number the program holds (item() of an input) have it still."""
        for pos, number in self.captured.valued_inputs:
            given = inputs[pos].item() if isinstance(inputs[pos], torch.Tensor) else inputs[pos]
            if given != number and not (given != given and number != number):  # NaN is NaN
                raise StitchflowError(f"input {self.captured.input_names[pos]} is read as a number, compiled as "
                                      f"{number}; called with {given}: compile again for it")

    def _write_inputs(self, inputs, env: Mapping[str, torch.Tensor]) -> None:
        """The inputs the model writes in place (x += 1, cache[pos] = k) get the values they end with, as in
        eager, after the call computed them all."""
        for pos, name in self.captured.input_writes:
            value = env[name]
            if name in self.captured.layouts:
                value = value.permute(inverse_permutation(self.captured.layouts[name]))
            with torch.no_grad():
                inputs[pos].copy_(value)

    def outputs_of(self, env: Mapping[str, torch.Tensor]):
        """The caller's outputs, in the structure the model returns them, from the graph's values in
        `env` (what a call returns; a target's simulator uses it too)."""
        return rebuild_outputs(self.captured, env)

    def grad_params(self) -> list:
        """The reference model's parameters that autograd tracks now (the list of parameters is
        walked once; whether each requires grad is asked per call)."""
        if self._parameters is None:
            module = self.reference if isinstance(self.reference, torch.nn.Module) else None
            self._parameters = list(module.parameters()) if module is not None else []
        return [p for p in self._parameters if p.requires_grad]

    def _replayed(self) -> None:
        self.regions_executed += len(self._compiled)

    def _run(self, env: dict, runs: Sequence | None = None) -> dict:
        """The regions' runs on `env` (or `runs`: the regions' runs up to a graph's tail)."""
        if not self._prefetched:
            self._prefetched = True
            prefetch = getattr(self.target, "prefetch", None)  # a target's compiles queued ahead, all at once
            if prefetch is not None and self.options.get("prefetch", True):
                prefetch(self.graph, self._compiled, env)
        for run in self._compiled if runs is None else runs:
            run(env)
            self.regions_executed += 1
        return env

    def _bind(self, inputs) -> dict[str, Any]:
        """The environment of a call: parameters and the checked inputs, by IR name."""
        graph = self.graph
        drawn = self.captured.random_seed is not None  # (the seed, appended by _forward)
        if len(inputs) - drawn != len(self.captured.input_names):
            raise ShapeError(f"the program takes {len(self.captured.input_names)} inputs, got {len(inputs) - drawn}")
        env: dict[str, Any] = dict(self.captured.param_values)
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        layouts = self.captured.layouts
        for name, value in zip(graph.inputs, tensors):
            if value.is_complex():  # the graph takes its real and imaginary parts, (..., 2) (capture)
                value = torch.view_as_real(value.resolve_conj())
            if name in layouts:
                value = value.permute(layouts[name])
            expected = graph.type_of[name]
            if tuple(value.shape) != expected.shape or value.dtype != expected.dtype:
                raise ShapeError(
                    f"input {name}: expected {expected}, got {str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
                )
            env[name] = value
        if self.target_name == "gpu":
            self._scalars_to_device(env)
        return env

    def _scalars_to_device(self, env: dict) -> None:
        """0-dim CPU tensors beside CUDA ones, moved to the device: eager takes them as scalars, kernels take
        device pointers (AOTAutograd lifts a tensor the model makes from a Python number, DeBERTa's
        torch.tensor(head_dim) or a dtype's minimum in BART's mask, as such a constant; a kernel whose first input
        it was also allocated its outputs on the CPU). The device is that of the CUDA tensors, or options["device"]
        (the backend's, for a partition whose only tensor inputs are such constants). Which names move is worked
        out on the first call."""
        if self._scalar_moves is None:
            tensors = [(n, v) for n, v in env.items() if isinstance(v, torch.Tensor)]
            device = next((v.device for _, v in tensors if v.device.type == "cuda"), self.options.get("device"))
            names = tuple(n for n, v in tensors if v.dim() == 0 and v.device.type == "cpu") if device else ()
            self._scalar_moves = (device, names)
        device, names = self._scalar_moves
        for name in names:
            env[name] = env[name].to(device, non_blocking=True)

    def simulate(self, *inputs, **timing):
        """Cycle-level simulation of the compiled regions (targets that model time: dataflow).
        Returns the target's result: outputs, total cycles and counters per region and in total."""
        simulate = getattr(self.target, "simulate", None)
        if simulate is None:
            raise StitchflowError(f"target {self.target_name!r} has no simulator")
        env = self._bind(inputs)
        return simulate(self, env, **timing)

    def explain(self) -> str:
        from .planner.explain import explain_program

        return explain_program(self)

    def __repr__(self) -> str:
        return f"<stitchflow.Program target={self.target_name} fusion={self.fusion} regions={len(self.regions)}>"


def _split_formats(model, formats: Mapping | None):
    """User formats: int positions and input names go to inputs, parameter paths to parameters;
    a model may declare default formats in `param_formats` and `buffer_formats` attributes."""
    params = set(dict(model.named_parameters()).keys()) | set(dict(model.named_buffers()).keys()) if isinstance(
        model, torch.nn.Module) else set()
    param_formats = dict(getattr(model, "param_formats", {}) or {}) | dict(getattr(model, "buffer_formats", {}) or {})
    input_formats = {}
    for key, value in (formats or {}).items():
        if isinstance(key, str) and key in params:
            param_formats[key] = value
        else:
            input_formats[key] = value
    return input_formats, param_formats


def _traceable(fn, n_inputs: int):
    """FX traces modules and Python functions; wrap builtins, partials and functions with extra
    defaulted parameters (F.silu's `inplace`) in a function of `n_inputs` named parameters."""
    if isinstance(fn, torch.nn.Module):
        return fn
    if inspect.isfunction(fn):
        params = inspect.signature(fn).parameters.values()
        plain = all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
        if plain and len(params) == n_inputs:
            return fn
    params = ", ".join(f"x{i}" for i in range(n_inputs))
    scope = {"fn": fn}
    exec(f"def call({params}):\n    return fn({params})", scope)
    return scope["call"]


class _AsModule(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def _register_output_pytrees(module: torch.nn.Module) -> None:
    """transformers' models return their key/value caches (DynamicCache, EncoderDecoderCache), which
    torch.export cannot flatten until they are registered as pytree nodes; transformers registers them
    for its own exporter, with the helper of its version (once per class, so calling again is free)."""
    if "transformers" not in sys.modules:
        return
    from transformers import PreTrainedModel

    hf = next((m for m in module.modules() if isinstance(m, PreTrainedModel)), None)
    if hf is None:
        return
    try:  # recent transformers: every Cache subclass, and the model's own cache classes
        from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model
    except ImportError:  # older ones
        from transformers.integrations.executorch import register_dynamic_cache_export_support

        register_dynamic_cache_export_support()  # DynamicCache alone
    else:
        register_cache_pytrees_for_model(hf)


def capture_model(model, example_inputs: Sequence[Any], formats: Mapping | None = None,
                  example_kwargs: Mapping[str, Any] | None = None) -> Captured:
    """Trace with FX symbolic tracing (works with sparse inputs); if the model cannot be traced
    symbolically (data-dependent control flow), fall back to torch.export for dense inputs. Keyword
    inputs go to torch.export directly; the graph takes them after the positional ones, in their order."""
    input_formats, param_formats = _split_formats(model, formats)
    gm = None
    if not example_kwargs:
        model = _traceable(model, len(example_inputs))
        try:
            gm = symbolic_trace(model)
        except Exception as err:  # tracing raises many kinds of errors; say which and try export
            if _any_sparse(example_inputs):
                raise StitchflowError(f"cannot trace the model symbolically ({err}); sparse inputs need a traceable "
                                      "model") from err
            log.info("symbolic tracing failed (%s); trying torch.export", err)
    depth = getattr(model, "partial_depth", 1)

    def lower(graph_module: torch.fx.GraphModule) -> Captured:
        inputs, formats = example_inputs, param_formats
        if getattr(graph_module, "_stitchflow_exported", False):  # keyword inputs follow the positional ones
            inputs = (*example_inputs, *(example_kwargs or {}).values())
            formats = {k: v for k, v in param_formats.items() if hasattr(graph_module, k.split(".")[0])}
        return capture(graph_module, inputs, input_formats=input_formats, param_formats=formats, partial_depth=depth,
                       input_writes=True)

    try:
        return lower(gm if gm is not None else _export(model, example_inputs, example_kwargs))
    except UnsupportedOpError as err:
        # a write through a view (row = z[0]; row += 1) has no IR form, but torch.export's functionalization
        # rewrites it as select_scatter and kin; sparse inputs cannot take that road
        if "shares memory" not in err.reason or _any_sparse(example_inputs):
            raise
        log.info("%s; trying torch.export, which functionalizes writes through views", err)
    return lower(_export(model, example_inputs, example_kwargs, functionalize=True))


def _any_sparse(inputs: Sequence[Any]) -> bool:
    return any(isinstance(x, torch.Tensor) and x.layout != torch.strided for x in inputs)


def _export(model, args: Sequence[Any], kwargs: Mapping[str, Any] | None,
            functionalize: bool = False) -> torch.fx.GraphModule:
    """torch.export's graph; `functionalize` rewrites in-place ops (a write through a view becomes
    select_scatter and kin) without decomposing anything else."""
    module = model if isinstance(model, torch.nn.Module) else _AsModule(model)
    _register_output_pytrees(module)
    try:
        program = torch.export.export(module, tuple(args), dict(kwargs) if kwargs else None)
        gm = (program.run_decompositions({}) if functionalize else program).module()
        gm._stitchflow_exported = True
        return gm
    except RuntimeError as export_err:
        if "which is not a known type" not in str(export_err):
            raise
        raise StitchflowError(f"torch.export cannot flatten what the model returns ({export_err}). Register "
                              "that class with torch.utils._pytree.register_pytree_node, or compile a wrapper "
                              "that returns its tensors") from export_err


def compile(model_or_fn, example_inputs: Sequence[Any] = (), *, example_kwargs: Mapping[str, Any] | None = None,
            target: str = "reference", fusion="unfused", formats: Mapping | None = None,
            options: Mapping | None = None) -> Program:
    """Capture `model_or_fn` on `example_inputs` (and keyword inputs `example_kwargs`, as a
    transformers model is called: input_ids=..., attention_mask=...) and compile it for `target`.
    The program is called as the model was: the same positional inputs, the same keywords.

    fusion: "unfused" | "partial" | "full" | "auto" | a list of regions (each a list of node,
    torch-op or submodule names). formats: {input position or name, or parameter path: format
    name} such as {0: "dcsr"} or {"layer1.weight": "dcsr"}; see stitchflow.ir.types.FORMAT_NAMES.
    """
    captured = capture_model(model_or_fn, example_inputs, formats, example_kwargs)
    flat = (*example_inputs, *(example_kwargs or {}).values())
    # the planner measures densities on the real tensors, and explain() reads the same values
    values = dict(captured.param_values) | {
        name: x for name, x in zip(captured.graph.inputs, [x for x in flat if isinstance(x, torch.Tensor)])}
    regions = regions_for(captured.graph, fusion, target=target, values=values)
    prog = Program(captured, regions, target, fusion, options, examples=values)
    prog.plan_values = values
    prog.reference = model_or_fn
    if example_kwargs:
        prog.signature = CallSignature(len(example_inputs), tuple(example_kwargs),
                                       {k: v for k, v in example_kwargs.items() if not isinstance(v, torch.Tensor)})
        prog.reference = _FlatCall(model_or_fn, prog.signature)
    return prog


@dataclass(frozen=True)
class CallSignature:
    """How a program compiled with keyword inputs is called: `positional` inputs, then the keywords
    `names`, which the graph takes after them in this order; `constants` are the keywords that are no
    tensors (use_cache=False), fixed at compile time."""

    positional: int
    names: tuple[str, ...]
    constants: Mapping[str, Any]

    def flatten(self, inputs: tuple, kwargs: Mapping[str, Any]) -> tuple:
        if len(inputs) != self.positional or set(kwargs) != set(self.names):
            raise StitchflowError(f"the program was compiled for {self.positional} positional inputs and the keywords "
                                  f"{', '.join(self.names)}; called with {len(inputs)} and "
                                  f"{', '.join(kwargs) or 'none'}")
        for name, value in self.constants.items():
            if kwargs[name] != value:
                raise StitchflowError(f"the program was compiled for {name}={value!r}, called with {kwargs[name]!r}")
        return (*inputs, *(kwargs[name] for name in self.names))

    def unflatten(self, flat: Sequence[Any]) -> tuple[tuple, dict]:
        return tuple(flat[:self.positional]), dict(zip(self.names, flat[self.positional:]))


class _FlatCall(torch.nn.Module):
    """A model or function compiled with keyword inputs, called with the program's flat inputs (what
    the recomputed backward runs again); its parameters are the model's."""

    def __init__(self, model, signature: CallSignature):
        super().__init__()
        self.model, self.signature = model, signature

    def forward(self, *flat):
        args, kwargs = self.signature.unflatten(flat)
        return self.model(*args, **kwargs)


class _RecomputedBackward(torch.autograd.Function):
    """The program's outputs, with a backward that runs the reference model again under autograd
    and differentiates it: eager's gradients for the tracked inputs and parameters (passed in as
    `tracked` so that autograd reaches them), at the cost of one more eager forward."""

    @staticmethod
    def forward(ctx, prog: Program, inputs: tuple, structure: dict, *tracked):
        ctx.prog, ctx.inputs = prog, inputs
        # inputs the model writes in place, as they came: the recomputation starts from them, not from the
        # values the forward left in the caller's tensors
        ctx.before = {pos: inputs[pos].detach().clone() for pos, _ in prog.captured.input_writes}
        ctx.save_for_backward(*tracked)
        leaves, structure["spec"] = tree_flatten(prog._forward(inputs))
        structure["leaves"] = leaves  # non-tensor leaves go back in place after apply
        tensors = tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))
        ctx.mark_non_differentiable(*(t for t in tensors if not t.is_floating_point()))
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        tracked = ctx.saved_tensors
        fresh = {}  # id of a tracked input -> its detached stand-in for the recomputation
        inputs = []
        for pos, x in enumerate(ctx.inputs):
            if pos in ctx.before:
                inputs.append(ctx.before[pos].clone())
            elif isinstance(x, torch.Tensor) and x.requires_grad and not isinstance(x, torch.nn.Parameter):
                fresh[id(x)] = x.detach().requires_grad_()
                inputs.append(fresh[id(x)])
            else:
                inputs.append(x)
        wrt = [fresh.get(id(t), t) for t in tracked]
        with torch.enable_grad():
            leaves, _ = tree_flatten(ctx.prog.reference(*inputs))
        return (None, None, None, *gradients([leaf for leaf in leaves if isinstance(leaf, torch.Tensor)], grads, wrt))


def gradients(outputs, grads, wrt) -> list:
    """d(outputs)/d(wrt) against the incoming `grads` (None where nothing flows)."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
    if not pairs or not wrt:
        return [None] * len(wrt)
    return list(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True))


def _with_recomputed_backward(prog: Program, inputs: tuple, tracked: list):
    structure: dict = {}
    tensors = iter(_RecomputedBackward.apply(prog, inputs, structure, *tracked))
    leaves = [next(tensors) if isinstance(leaf, torch.Tensor) else leaf for leaf in structure["leaves"]]
    return tree_unflatten(leaves, structure["spec"])
