"""Training through the torch.compile backend: forward and backward graphs both compiled.

Where autograd records through a Dynamo graph, AOTAutograd traces the joint forward-backward
graph in ATen ops, decomposes composite ops (layer norm's, softmax's and GELU's backward become
sums and elementwise arithmetic that the IR lowers), and splits it into a forward graph, which
also returns the tensors the backward needs, and a backward graph (torch's min-cut partitioner:
a cheap elementwise value is recomputed in the backward rather than saved, as Inductor does).
Each graph is then partitioned and compiled exactly like an inference graph (backend.py), so the
backward's row reductions (norm gradients), column reductions (bias gradients) and elementwise
chains are stitched into few kernels; what has no lowering (a convolution's backward) runs
eagerly and is recorded with its reason.

If AOTAutograd cannot trace the graph, the caller falls back to the recomputed backward
(backend._RecomputedBackward): gradients stay eager's, nothing is lost."""

from __future__ import annotations

import functools
import logging
import math
import operator

import torch
import torch.fx as fx

from . import backend
from .backend_layouts import (like_parameters, pointwise_weight_gradient, saved_outputs_start,
                              unfolded_weight_gradient, written_back_inputs)
from .frontend import attention_rewrite
from .ir.errors import StitchflowError
from .replay import AotGraphReplay

aten = torch.ops.aten
log = logging.getLogger("stitchflow.training")

# ATen ops that core ATen keeps whole but whose decompositions lower: training batch norm, its
# running-statistics update made functional (AOTAutograd copies the new statistics back).
_EXTRA_DECOMPOSITIONS = (aten._native_batch_norm_legit_functional.default,)


def _batch_norm_with_running_statistics(x, weight, bias, running_mean, running_var, momentum, eps):
    """Batch norm in eval mode (aten._native_batch_norm_legit_no_training), as elementwise ops over
    per-channel statistics; torch's own decomposition calls the in-place training op, which a
    functional graph may not hold. Half-precision inputs are normalised in float32, as eager's
    kernels do; the last two results (saved statistics) are empty, as eager's are."""
    shape = [1, -1] + [1] * (x.dim() - 2)
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    out = (x.to(acc) - running_mean.to(acc).view(shape)) * torch.rsqrt(running_var.to(acc).view(shape) + eps)
    if weight is not None:
        out = out * weight.to(acc).view(shape)
    if bias is not None:
        out = out + bias.to(acc).view(shape)
    empty = x.new_empty((0,), dtype=acc)
    return out.to(x.dtype), empty, empty


# ATen ops that must stay whole: the CPU flash attention's decomposition saves a logsumexp that its
# backward kernel (which has none) reads in another layout, so gradients came out wrong (torch 2.13;
# Inductor's table leaves it out too).
_KEPT_WHOLE = (aten._scaled_dot_product_flash_attention_for_cpu.default,)


@functools.cache
def decompositions() -> dict:
    from torch._decomp import core_aten_decompositions, decomposition_table

    table = dict(core_aten_decompositions())
    table.update({op: decomposition_table[op] for op in _EXTRA_DECOMPOSITIONS if op in decomposition_table})
    table[aten._native_batch_norm_legit_no_training.default] = _batch_norm_with_running_statistics
    for op in _KEPT_WHOLE:
        table.pop(op, None)
    return table


def compile_forward_and_backward(gm: fx.GraphModule, example_inputs, options: dict):
    """The Dynamo graph `gm` compiled through AOTAutograd with stitchflow compiling both halves;
    None (after recording why) where AOTAutograd cannot trace it. Attention written as products and
    a softmax goes to torch's fused attention first where it needs no mask or a causal one
    (frontend/attention_rewrite.py; options {"attention": "masked"} rewrites any mask too, False none)."""
    mode = options.get("attention", True)
    if mode not in (True, False, "masked"):
        raise StitchflowError(f"options['attention'] must be True (attention without a mask or with a causal one "
                              f"runs as torch's fused attention), 'masked' (any mask too) or False, not {mode!r}")
    if mode is False:
        return _through_aot(gm, example_inputs, options)
    try:
        rewritten, found, refused = attention_rewrite.rewritten(gm, example_inputs, masked=mode == "masked")
    except Exception as err:  # a matcher bug costs the rewrite, never the compile
        log.warning("attention rewrite failed, the graph is compiled as written: %s: %s", type(err).__name__, err)
        return _through_aot(gm, example_inputs, options)
    for why in refused:
        log.info("%s", why)
    if not found:
        return _through_aot(gm, example_inputs, options)
    for att in found:
        log.info("%s -> F.scaled_dot_product_attention", att)
    compiled = _through_aot(rewritten, example_inputs, options, record=False)
    if compiled is None:  # AOTAutograd failed on the rewrite: the graph as written
        return _through_aot(gm, example_inputs, options)
    guarded = [a.causal for a in found if a.causal is not None and a.causal.positions]
    if not guarded or not all(isinstance(x, (torch.Tensor, int, float, bool)) for x in example_inputs):
        return compiled

    def general():
        log.info("a causal mask input changed: the graph is compiled again with its masks as masks")
        masked, kept, _ = attention_rewrite.rewritten(gm, example_inputs, causal=False, masked=mode == "masked")
        return ((kept and _through_aot(masked, example_inputs, options, record=False))
                or _through_aot(gm, example_inputs, options) or gm.forward)

    return attention_rewrite.CausalGuard(compiled, guarded, example_inputs, general)


def compile_through_functorch(gm: fx.GraphModule, example_inputs, options: dict, why: str):
    """A graph that holds torch.func transforms (`why`) traced by AOTAutograd into plain ATen ops, vmaps batched
    and gradients taken, and compiled like any other (its inference graph, or its forward and backward); None
    where AOTAutograd cannot trace it (the graph is then partitioned as Dynamo wrote it)."""
    log.info("%s: the graph goes through AOTAutograd, which traces the transforms into ATen ops", why)
    return _through_aot(gm, example_inputs, options, record=False)


def _through_aot(gm: fx.GraphModule, example_inputs, options: dict, record: bool = True):
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    compile_with_aot = aot_autograd(
        fw_compiler=functools.partial(_compile_half, options=options, label="forward"),
        bw_compiler=functools.partial(_compile_half, options=options, label="backward"),
        inference_compiler=functools.partial(_compile_half, options=options, label="inference"),
        partition_fn=functools.partial(_partition, min_cut_rematerialization_partition),
        decompositions=decompositions(),
    )
    try:
        return compile_with_aot(gm, example_inputs)
    except torch._dynamo.exc.RestartAnalysis:  # Dynamo's signal to trace again (a float input made a tensor): not ours
        raise
    except Exception as err:  # e.g. an op with no fake-tensor rule: training still works, recomputed
        if not record:
            log.info("AOTAutograd could not trace the graph (its attention rewritten, or torch.func transforms): "
                     "%s: %s", type(err).__name__, err)
            return None
        backend._record(f"AOTAutograd could not trace the graph ({len(gm.graph.nodes)} nodes), so its backward "
                        f"differentiates an eager rerun: {type(err).__name__}: {err}")
        return None


def _partition(partition_fn, joint_module, joint_inputs, **kwargs):
    """AOTAutograd's partition, then the backward's rewrites: constants it would take from the forward
    computed in it, convolution bias gradients as sums, weight gradients as GEMMs where cuDNN is slow,
    and the weight gradients it returns in their parameters' layout."""
    forward, backward = partition_fn(joint_module, joint_inputs, **kwargs)
    recomputed = recompute_constants(forward, backward)
    sums, gemms = bias_gradients_as_sums(backward), weight_gradients_as_gemms(backward)
    laid = gradients_like_parameters(backward, joint_inputs[0] if joint_inputs else ())
    if recomputed or sums or gemms or laid:
        log.info("backward graph: %d saved constants recomputed, %d convolution bias gradients as sums, %d weight "
                 "gradients as GEMMs, %d weight gradients copied into their parameters' layout in one launch",
                 len(recomputed), sums, gemms, laid)
    return forward, backward


def bias_gradients_as_sums(backward: fx.GraphModule) -> int:
    """Each convolution backward's bias gradient taken out of it, as a sum of the output's gradient over
    every axis but the channels (a transposed convolution's too): an op of the graph, which stitchflow
    compiles with the gradient's other readers, where ATen's convolution_backward ran it as a torch
    reduction of its own (a U-Net's 18 took 202 µs of an H100 step; Inductor sums them in its kernels
    too). Returns how many it took out."""
    taken = 0
    for node in _convolution_backwards(backward.graph, output=2):
        grad = node.args[0]
        val = grad.meta.get("val") if isinstance(grad, fx.Node) else None
        if isinstance(val, torch.Tensor):
            _take_out(backward.graph, node, 2, aten.sum.dim_IntList, (grad, [0, *range(2, val.dim())]))
            taken += 1
    return _recompiled(backward, taken)


THIN_CHANNELS = 8  # cuDNN pads an input with fewer channels to 8 for its tensor-core weight-gradient kernels


def weight_gradients_as_gemms(backward: fx.GraphModule) -> int:
    """Weight gradients taken out of their convolution_backward (one group, not transposed) as GEMMs over the
    positions: a 1x1 convolution's (stride 1, no padding or dilation) over the input as it is
    (`pointwise_weight_gradient`), and a 2-d convolution's over a thin input (fewer than THIN_CHANNELS channels,
    a window of them no wider than the output's channels, so the unfolded input is no larger than the
    gradient) over its unfolded windows (`unfolded_weight_gradient`). Returns how many it took out."""
    taken = 0
    for node in _convolution_backwards(backward.graph, output=1):
        grad, x, w, _, stride, padding, dilation, transposed, _, groups, _ = node.args
        shape = tuple(w.meta["val"].shape) if isinstance(w, fx.Node) and "val" in w.meta else None
        if shape is None or transposed or groups != 1:
            continue
        window = shape[1] * math.prod(shape[2:])
        if all(k == 1 for k in shape[2:]) and all(s == 1 for s in stride) and not any(padding) and \
                all(d == 1 for d in dilation):
            _take_out(backward.graph, node, 1, pointwise_weight_gradient, (grad, x, shape))
        elif len(shape) == 4 and shape[1] < THIN_CHANNELS and window <= shape[0] and \
                any(k != 1 for k in shape[2:]):
            _take_out(backward.graph, node, 1, unfolded_weight_gradient, (grad, x, shape, stride, padding, dilation))
        else:
            continue
        taken += 1
    return _recompiled(backward, taken)


def gradients_like_parameters(backward: fx.GraphModule, primals) -> int:
    """The weight gradients the backward returns straight from a convolution's backward for NCHW
    parameters, passed through one `like_parameters` call: cuDNN returns them channels last when it runs
    so, and autograd copied each into its parameter's layout by itself. (The backward returns one gradient
    per primal, in order. An image's gradient is left to autograd's copy: the launch's tiles are a
    weight's, and ResNet-18's 32x3x224x224 image gradient in them made its step 3602 µs against
    3403.) Returns how many it passes."""
    output = next(n for n in backward.graph.nodes if n.op == "output")
    outs = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    picked = [k for k, (g, p) in enumerate(zip(outs, primals))
              if isinstance(g, fx.Node) and g.target is operator.getitem and g.args[1] == 1 and
              getattr(g.args[0], "target", None) is aten.convolution_backward.default and
              isinstance(p, torch.Tensor) and p.dim() in (4, 5) and p.is_contiguous()]
    if not picked:
        return 0
    with backward.graph.inserting_before(output):
        laid = backward.graph.call_function(like_parameters, tuple(outs[k] for k in picked))
        for k in picked:
            item = backward.graph.call_function(operator.getitem, (laid, picked.index(k)))
            item.meta.update(outs[k].meta)
            outs[k] = item
    output.args = (tuple(outs) if isinstance(output.args[0], (tuple, list)) else outs[0],)
    return _recompiled(backward, len(picked))


def _convolution_backwards(graph: fx.Graph, output: int) -> list[fx.Node]:
    """The convolution_backward nodes that compute their `output` (0: the input's gradient, 1: the
    weight's, 2: the bias')."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target is aten.convolution_backward.default
            and len(n.args) == 11 and n.args[10][output]]


def _take_out(graph: fx.Graph, node: fx.Node, output: int, target, args: tuple) -> None:
    """`node`'s `output` computed by `target(*args)` instead: what read it reads that, and the convolution
    backward no longer computes it (nor runs, when nothing of it is left)."""
    items = [u for u in node.users if u.target is operator.getitem and u.args[1] == output]
    if items:
        with graph.inserting_after(node):
            value = graph.call_function(target, args)
        value.meta.update(items[0].meta)
        for item in items:
            item.replace_all_uses_with(value)
            graph.erase_node(item)
    mask = list(node.args[10])
    mask[output] = False
    node.args = (*node.args[:10], mask)
    if isinstance(val := node.meta.get("val"), (tuple, list)):
        node.meta["val"] = tuple(None if k == output else v for k, v in enumerate(val))
    if not any(mask) and not node.users:
        graph.erase_node(node)


def _recompiled(gm: fx.GraphModule, changes: int) -> int:
    if changes:
        gm.graph.lint()
        gm.recompile()
    return changes


CONSTANT_MOST = 1 << 16  # elements of a saved constant the backward recomputes rather than reads


def recompute_constants(forward: fx.GraphModule, backward: fx.GraphModule) -> list[str]:
    """Saved tensors that the forward computes from no input (integer constants of at most CONSTANT_MOST
    elements: nearest upsampling's source rows, arange(2n) // 2) computed again in the backward, which
    then sees a constant, not data: its scatter-add over them becomes a sum of windows there
    (targets/gpu/rewrites.window_scatters). The forward still returns them (a few bytes); the backward's
    placeholders stay, unused. Returns the names recomputed."""
    made = {n.name: n for n in forward.graph.nodes}
    placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"]
    first = next(n for n in backward.graph.nodes if n.op != "placeholder")
    done = []
    for ph in placeholders:
        source = made.get(ph.name)
        computed = _constant_inputs(source) if ph.users and source is not None and _small_integer(source) else None
        if computed is None:
            continue
        env: dict = {}
        with backward.graph.inserting_before(first):  # in the forward's order, before the backward's own work
            for node in computed:
                env[node] = backward.graph.node_copy(node, lambda a: env[a])
        ph.replace_all_uses_with(env[source])
        done.append(ph.name)
    _recompiled(backward, len(done))
    return done


def _small_integer(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and not val.is_floating_point() and not val.is_complex() and \
        val.numel() <= CONSTANT_MOST


def _constant_inputs(node: fx.Node) -> list[fx.Node] | None:
    """`node` and what it is computed from, in graph order, when nothing of it is an input or drawn at
    random; None otherwise."""
    seen: set = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op != "call_function" or (isinstance(n.target, torch._ops.OpOverload)
                                       and torch.Tag.nondeterministic_seeded in n.target.tags):
            return None
        todo += n.all_input_nodes
    order = {n: k for k, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _compile_half(gm: fx.GraphModule, example_inputs, *, options: dict, label: str):
    """One of AOTAutograd's graphs as a callable in its boxed convention (a list of arguments)."""
    from torch._functorch.aot_autograd import make_boxed_func

    try:
        wrapped = backend._partition_and_wrap(gm, options, label)
    except Exception as err:  # never the user's run: the graph runs as AOTAutograd traced it
        backend._record(f"{label} graph ({len(gm.graph.nodes)} nodes): {type(err).__name__}: {err}")
        wrapped = gm
    fn = wrapped.forward
    if label in ("forward", "backward") and options.get("cuda_graphs", True) and _on_cuda(example_inputs):
        # the whole graph, eager ops and all, as one CUDA graph: a training step is host-bound
        # otherwise (a cuDNN convolution backward alone costs 0.17 ms of host time)
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        n_outputs = len(outputs) if isinstance(outputs, (tuple, list)) else 1
        # handed over: the forward's saved activations, and every gradient of the backward (autograd
        # accumulates them into .grad; the replay overwrites none while anyone holds it)
        free_from = saved_outputs_start(label) if label == "forward" else 0
        fn = AotGraphReplay(fn, n_outputs, free_from, options.get("cuda_graphs") == "always",
                            written_back=written_back_inputs(label))
    return make_boxed_func(fn)


def _on_cuda(example_inputs) -> bool:
    return any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)
