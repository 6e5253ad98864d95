"""`stitchflow.compile`: capture a model, choose fusion regions, compile them for a target.

    prog = stitchflow.compile(model, (A, X), target="reference", fusion="partial")
    y = prog(A, X)            # runs the regions
    prog.regions              # the fusion regions
    print(prog.explain())     # why each pair of neighbouring ops is or is not fused
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Any, Mapping, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .frontend.capture import Captured, capture, rebuild_outputs, symbolic_trace
from .ir.errors import ShapeError, StitchflowError
from .ir.graph import Graph, Region
from .planner.regions import regions_for
from .targets import get_target

log = logging.getLogger("stitchflow")


class Program:
    def __init__(self, captured: Captured, regions: Sequence[Region], target: str, fusion, options=None):
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
        self._parameters: list | None = None  # the reference's parameters (grad_params)
        refusals = [(r, self.target.check_region(self.graph, r)) for r in self.regions]
        bad = [(r, why) for r, why in refusals if why]
        if bad:
            r, why = bad[0]
            raise StitchflowError(f"target {target!r} cannot run region {r.name}: {why}")
        self._compiled = [self.target.compile_region(self.graph, r, captured.param_values, self.options) for r in self.regions]
        use_graphs = self.options.get("cuda_graphs", target == "gpu")
        if use_graphs not in (True, False, "always"):
            raise StitchflowError(f"options['cuda_graphs'] must be True (replay where a replay is faster), False or "
                                  f"'always' (replay even where it is slower), not {use_graphs!r}")
        self._replay = _GraphReplay(self, keep_always=use_graphs == "always") if use_graphs else None

    @property
    def graph(self) -> Graph:
        return self.captured.graph

    @property
    def compiled(self) -> tuple:
        """The target's runner for each region, in region order (targets attach what they
        built to it: dataflow graphs, kernels, token counts)."""
        return tuple(self._compiled)

    def __call__(self, *inputs):
        if self.reference is not None and torch.is_grad_enabled():
            needs = self.grad_params() + [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
            if needs:
                return _with_recomputed_backward(self, inputs, needs)
        return self._forward(inputs)

    def _forward(self, inputs):
        if self._replay is not None and self._replay.applies(inputs):
            return self._replay(inputs)
        return rebuild_outputs(self.captured, self._run(self._bind(inputs)))

    def grad_params(self) -> list:
        """The reference model's parameters that autograd tracks now (the list of parameters is
        walked once; whether each requires grad is asked per call)."""
        if self._parameters is None:
            module = self.reference if isinstance(self.reference, torch.nn.Module) else None
            self._parameters = list(module.parameters()) if module is not None else []
        return [p for p in self._parameters if p.requires_grad]

    def _run(self, env: dict) -> dict:
        for run in self._compiled:
            run(env)
            self.regions_executed += 1
        return env

    def _bind(self, inputs) -> dict[str, Any]:
        """The environment of a call: parameters and the checked inputs, by IR name."""
        graph = self.graph
        if len(inputs) != len(self.captured.input_names):
            raise ShapeError(f"the program takes {len(self.captured.input_names)} inputs, got {len(inputs)}")
        env: dict[str, Any] = dict(self.captured.param_values)
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        layouts = self.captured.layouts
        for name, value in zip(graph.inputs, tensors):
            if name in layouts:
                value = value.permute(layouts[name])
            expected = graph.type_of[name]
            if tuple(value.shape) != expected.shape or value.dtype != expected.dtype:
                raise ShapeError(
                    f"input {name}: expected {expected}, got {str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
                )
            env[name] = value
        return env

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


class _GraphReplay:
    """Replays a whole call of a CUDA program as one CUDA graph, so that the Python dispatch of
    every region, kernel and library call leaves the hot path (torch.compile's reduce-overhead
    mode does the same). The first calls run normally (autotuning happens there); the second is
    timed, the graph captured on the third is timed too and kept only if it is faster: a replay
    copies the inputs in and clones the outputs out, which costs more than it saves when the
    device, not the host, is the bottleneck. A capture that fails (a host sync, a sparse op) is
    logged and the program keeps running normally. `keep_always` keeps a captured graph without
    the comparison (options={"cuda_graphs": "always"}: a host-bound loop whose timing at the third
    call is not representative, and tests that must exercise the replay whatever the timing)."""

    WARMUP_CALLS = 2

    def __init__(self, prog: Program, keep_always: bool = False):
        self.prog = prog
        self.keep_always = keep_always
        self.calls = 0
        self.failed: str | None = None  # why calls run without a graph (capture failed, not worth it)
        self.plain_ms = self.replay_ms = (float("inf"), float("inf"))  # (to the device's end, on the host)
        self.graph = None
        self.static_inputs: list[torch.Tensor] = []
        self.static_env: dict = {}

    def applies(self, inputs) -> bool:
        """CUDA inputs, dense or CSR (a GNN's adjacency); a CSR input must keep the non-zero count of
        the captured one (its structure is copied in, as a dense input's values are)."""
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        if self.failed is not None or not tensors or not all(
                t.is_cuda and t.layout in (torch.strided, torch.sparse_csr) for t in tensors):
            return False
        return self.graph is None or all(
            s.layout != torch.sparse_csr or s.values().numel() == t.values().numel()
            for s, t in zip(self.static_inputs, tensors))

    def __call__(self, inputs):
        prog = self.prog
        self.calls += 1
        if self.graph is None and self.calls < self.WARMUP_CALLS:
            return rebuild_outputs(prog.captured, prog._run(prog._bind(inputs)))
        if self.graph is None and self.calls == self.WARMUP_CALLS:
            self.plain_ms, env = _best_of(lambda: prog._run(prog._bind(inputs)))
            return rebuild_outputs(prog.captured, env)
        if self.graph is None:
            if not self._capture(inputs):
                return rebuild_outputs(prog.captured, prog._run(prog._bind(inputs)))
            self.replay_ms, outputs = _best_of(lambda: self._replay(inputs))
            if not self.keep_always and not self._worth_it():
                self.graph, self.static_inputs, self.static_env = None, [], {}
                log.info("stitchflow: no CUDA graph, %s", self.failed)
            return rebuild_outputs(prog.captured, outputs)
        return rebuild_outputs(prog.captured, self._replay(inputs))

    def _worth_it(self) -> bool:
        """A replay must be faster both to the end of its device work and on the host: a call that
        returns sooner but queues copies lengthens a step whose device is the bottleneck, and one
        that ends sooner in isolation but spends longer on the host (a copy and an allocation per
        input and output) lengthens a step whose host is (a training step's backward graphs)."""
        (plain, plain_host), (replay, replay_host) = self.plain_ms, self.replay_ms
        if replay < plain and replay_host < plain_host:
            return True
        self.failed = (f"not worth a graph: a replay took {replay:.3f} ms ({replay_host:.3f} ms on the host), a plain "
                       f"call {plain:.3f} ms ({plain_host:.3f} ms on the host)")
        return False

    def _replay(self, inputs) -> dict:
        prog = self.prog
        targets, sources = [], []
        for static, x in zip(self.static_inputs, [x for x in inputs if isinstance(x, torch.Tensor)]):
            if static.layout == torch.sparse_csr:  # the members are the static tensor's own storage
                targets += [static.crow_indices(), static.col_indices(), static.values()]
                sources += [x.crow_indices(), x.col_indices(), x.values()]
            else:
                targets.append(static)
                sources.append(x)
        # one foreach copy each way: a training step's graphs take and give a hundred activations,
        # and a copy_ or clone apiece cost more host time than the replay saves
        torch._foreach_copy_(targets, sources)
        self.graph.replay()
        prog.regions_executed += len(prog._compiled)
        names = list(dict.fromkeys(prog.graph.outputs))
        made = [self.static_env[name] for name in names]
        copies = [torch.empty_like(t) for t in made]
        torch._foreach_copy_(copies, made)
        return dict(zip(names, copies))

    def _capture(self, inputs) -> bool:
        prog = self.prog
        self.static_inputs = [x.clone() for x in inputs if isinstance(x, torch.Tensor)]
        static = iter(self.static_inputs)
        bound = [next(static) if isinstance(x, torch.Tensor) else x for x in inputs]
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # one run on a side stream, as torch's docs ask
                prog._run(prog._bind(bound))
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.static_env = prog._run(prog._bind(bound))
            self.graph = graph
            return True
        except Exception as err:  # capture refuses host syncs and some library calls
            self.failed = f"{type(err).__name__}: {err}"
            log.info("stitchflow: CUDA graph capture failed, running without it: %s", self.failed)
            torch.cuda.synchronize()
            return False


def _best_of(call, repeats: int = 3):
    """((the shortest wall time in ms of `call` to the end of its device work, the shortest until it
    returned), its last result)."""
    best, host, result = float("inf"), float("inf"), None
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = call()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        best, host = min(best, (time.perf_counter() - t0) * 1e3), min(host, (t1 - t0) * 1e3)
    return (best, host), result


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

    def forward(self, *args):
        return self.fn(*args)


def capture_model(model, example_inputs: Sequence[Any], formats: Mapping | None = None) -> Captured:
    """Trace with FX symbolic tracing (works with sparse inputs); if the model cannot be traced
    symbolically (data-dependent control flow), fall back to torch.export for dense inputs."""
    input_formats, param_formats = _split_formats(model, formats)
    model = _traceable(model, len(example_inputs))
    try:
        gm = symbolic_trace(model)
    except Exception as err:  # tracing raises many kinds of errors; say which and try export
        if any(isinstance(x, torch.Tensor) and x.layout != torch.strided for x in example_inputs):
            raise StitchflowError(f"cannot trace the model symbolically ({err}); sparse inputs need a traceable model") from err
        log.info("symbolic tracing failed (%s); trying torch.export", err)
        module = model if isinstance(model, torch.nn.Module) else _AsModule(model)
        gm = torch.export.export(module, tuple(example_inputs)).module()
        param_formats = {k: v for k, v in param_formats.items() if hasattr(gm, k.split(".")[0])}
    depth = getattr(model, "partial_depth", 1)
    return capture(gm, example_inputs, input_formats=input_formats, param_formats=param_formats, partial_depth=depth)


def compile(model_or_fn, example_inputs: Sequence[Any], *, target: str = "reference", fusion="unfused",
            formats: Mapping | None = None, options: Mapping | None = None) -> Program:
    """Capture `model_or_fn` on `example_inputs` and compile it for `target`.

    fusion: "unfused" | "partial" | "full" | "auto" | a list of regions (each a list of node,
    torch-op or submodule names). formats: {input position or name, or parameter path: format
    name} such as {0: "dcsr"} or {"layer1.weight": "dcsr"}; see stitchflow.ir.types.FORMAT_NAMES.
    """
    captured = capture_model(model_or_fn, example_inputs, formats)
    # the planner measures densities on the real tensors, and explain() reads the same values
    values = dict(captured.param_values) | {
        name: x for name, x in zip(captured.graph.inputs, [x for x in example_inputs if isinstance(x, torch.Tensor)])}
    regions = regions_for(captured.graph, fusion, target=target, values=values)
    prog = Program(captured, regions, target, fusion, options)
    prog.plan_values = values
    prog.reference = model_or_fn
    return prog


class _RecomputedBackward(torch.autograd.Function):
    """The program's outputs, with a backward that runs the reference model again under autograd
    and differentiates it: eager's gradients for the tracked inputs and parameters (passed in as
    `tracked` so that autograd reaches them), at the cost of one more eager forward."""

    @staticmethod
    def forward(ctx, prog: Program, inputs: tuple, structure: dict, *tracked):
        ctx.prog, ctx.inputs = prog, inputs
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
        for x in ctx.inputs:
            if isinstance(x, torch.Tensor) and x.requires_grad and not isinstance(x, torch.nn.Parameter):
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
