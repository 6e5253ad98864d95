"""Which tensors may cross a partition's boundary in a layout other than eager's.

A program stores activations around convolutions channels last (targets/gpu/channels_last.py).
Where an output of a partition is read by an eager op, it leaves in the strides eager traced
(backend._eager_layouts), since an ATen graph's next op was traced on them (a view would fail
on other strides). That copy is wasted where no reader depends on the layout:

- another stitchflow partition (it compiles for the strides it gets);
- a convolution or a convolution's backward (cuDNN takes any dense layout, and runs channels
  last without transposing it first);
- in AOTAutograd's forward graph, the graph's outputs past the user-visible ones: the tensors
  saved for the backward, which only the backward graph reads (and whose eager readers there
  get eager's strides back, `restride_placeholders`).

Such outputs are "free": the program may hand them over as permuted views (the same shape,
channels-last strides), and a partition given one reads it as stored (`input_orders`). A free
output that a convolution reads (a backward's gradient for cuDNN's convolution backward) is
stored channels last outright (`convolution_positions`, the program's `last_outputs`), even where
it leaves as a reshape of a node (group norm's gradient, computed per group): cuDNN given an NCHW
gradient transposed it, the input and the weight around each of its kernels.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

# eager ops that run as fast, or faster, on channels-last operands and return values whose
# readers compile for their strides
LAYOUT_FREE = frozenset({
    torch.ops.aten.convolution.default,
    torch.ops.aten.convolution_backward.default,
})


def saved_outputs_start(label: str) -> int | None:
    """In AOTAutograd's forward graph, the position of its first output saved for the backward
    (mutated inputs, user outputs and their bases come first); None for other graphs."""
    if label != "forward":
        return None
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None) if context is not None else None
    return getattr(meta, "num_forward", None)


def written_back_inputs(label: str) -> dict[int, int]:
    """In AOTAutograd's forward graph, {output position: input position} for the inputs whose new
    values the graph returns for AOTAutograd to copy back (batch norm's running statistics): data
    mutations only, not of leaves that require grad. Empty for other graphs."""
    if label != "forward":
        return {}
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None) if context is not None else None
    if meta is None:
        return {}
    pairs = {}
    for out, index in enumerate(getattr(meta, "mutated_inp_runtime_indices", ())):
        info = meta.input_info[index]
        if info.mutates_data and not info.mutates_metadata and not (info.is_leaf and info.requires_grad):
            pairs[out] = index
    return pairs


def free_positions(call: fx.Node, partitions: set, saved_from: int | None) -> frozenset:
    """The positions of a partition call's results (None: its single value) whose every reader
    is free of layout: another partition, a LAYOUT_FREE op, or the graph's output at saved positions."""
    def reads_freely(user: fx.Node, value: fx.Node) -> bool:
        if user.op == "output":
            return saved_from is not None and all(
                k >= saved_from for k, out in enumerate(_flat(user.args[0])) if out is value)
        if user.op == "call_module" and user.target in partitions:
            return True
        return user.op == "call_function" and user.target in LAYOUT_FREE

    items = [u for u in call.users if u.op == "call_function" and u.target is operator.getitem]
    if not items:
        return frozenset({None}) if call.users and all(reads_freely(u, call) for u in call.users) else frozenset()
    return frozenset(item.args[1] for item in items if item.users and all(reads_freely(u, item) for u in item.users))


def _flat(args) -> list:
    return list(args) if isinstance(args, (tuple, list)) else [args]


def restride_placeholders(gm: fx.GraphModule, eager) -> None:
    """Before a graph's inputs may arrive in other layouts (AOTAutograd's backward, whose saved
    tensors a forward partition may hand over channels last): each input read by an eager op
    (`eager(node)`) that is not LAYOUT_FREE gets the strides it was traced with, by a copy where
    they differ."""
    for ph in [n for n in gm.graph.nodes if n.op == "placeholder"]:
        val = ph.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() < 3:
            continue
        readers = [u for u in ph.users if eager(u) and u.target not in LAYOUT_FREE]
        if not readers:
            continue
        with gm.graph.inserting_after(ph):
            fixed = gm.graph.call_function(restrided, (ph, tuple(int(s) for s in val.stride())))
        for u in readers:
            u.replace_input_with(ph, fixed)
    gm.recompile()


def convolution_inputs_like_gradients(gm: fx.GraphModule) -> None:
    """Before each eager convolution backward of a graph input (a network's first convolution reads
    the user's image, NCHW): the input in the gradient's layout where that is channels last
    (`like_gradient`). cuDNN runs in the input's suggested format, so with an NCHW input and a
    channels-last gradient (ours) ATen converted the gradient to NCHW and cuDNN converted both back
    to NHWC around its kernels: ResNet-18's stem backward spent 199 + 49 + 69 + 51 µs in such copies
    (H100); converting the image (3 channels, a tenth of the gradient's bytes) instead made the whole
    step 358 µs faster."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.convolution_backward.default:
            continue
        grad, x, w = node.args[0], node.args[1], node.args[2]
        if not isinstance(grad, fx.Node):
            continue
        for value, like in ((x, like_gradient), (w, weight_like_gradient)):
            if isinstance(value, fx.Node) and value.op == "placeholder":
                with gm.graph.inserting_before(node):
                    moved = gm.graph.call_function(like, (value, grad))
                node.replace_input_with(value, moved)
    gm.recompile()


def like_gradient(x, grad):
    """`x` channels last (a copy) where `grad` is stored channels last and `x` is not; else `x`. On a
    GPU the copy is one transposing Triton launch (targets/gpu/planes.py), not torch's strided copy."""
    last = _channels_last_format(x)
    if last is None or x.is_contiguous(memory_format=last) or grad.is_contiguous() or \
            not grad.is_contiguous(memory_format=last):
        return x
    if x.is_cuda:
        from .targets.gpu.planes import to_channels_last

        return to_channels_last(x)
    return x.contiguous(memory_format=last)


def weight_like_gradient(w, grad):
    """A convolution's weight in its gradient's memory format (a copy where they differ): a weight
    the forward saved channels last (`saved_weights_channels_last`) meets an NCHW gradient where a
    convolution's output left the forward in eager's layout, and cuDNN would otherwise convert the
    gradient and the input to the weight's format."""
    last = _channels_last_format(w)
    if last is None or not isinstance(grad, torch.Tensor) or grad.dim() != w.dim():
        return w
    if grad.is_contiguous(memory_format=last) and not grad.is_contiguous():
        return w if w.is_contiguous(memory_format=last) else w.contiguous(memory_format=last)
    if grad.is_contiguous() and not grad.is_contiguous(memory_format=last):
        return w if w.is_contiguous() else w.contiguous()
    return w


def weights_channels_last(*weights) -> tuple:
    """Convolution weights stored channels last (copies made once per forward, one launch on a GPU:
    targets/gpu/weights.py)."""
    from .targets.gpu.weights import channels_last_copies

    return channels_last_copies(weights)


def like_parameters(*grads) -> tuple:
    """Weight gradients of NCHW parameters that cuDNN returned channels last, copied contiguous in one
    launch (targets/gpu/weights.py): autograd's AccumulateGrad keeps a gradient only in its parameter's
    layout and otherwise copied each one by itself (U-Net: 17 launches, 50 µs a step)."""
    from .targets.gpu.weights import contiguous_copies

    return contiguous_copies(grads)


def _channels_last_format(t):
    # targets/gpu/conv.channels_last_format's twin: importing the gpu target here would load Triton with the backend
    return {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim()) if isinstance(t, torch.Tensor) else None


def pointwise_weight_gradient(grad, x, weight_shape):
    """A 1x1 convolution's weight gradient (stride 1, no padding, one group) as GEMMs over the
    positions, grad^T · x: cuDNN handed it to a cuBLAS kernel with no split over the positions
    (U-Net's 128 -> 64 skip at 8x64x64, K = 32768: 46 µs on an H100, where `torch.mm` of the same
    operands takes 15). Operands are read as stored: both channels last, one GEMM over every position
    (cuBLAS accumulates in float32 and rounds once; asked for a float32 result, torch 2.11 ran a
    CUTLASS fallback with 2-byte alignment, 78 µs); otherwise one per image (a batched GEMM) into
    float32, summed."""
    (g, g_last), (a, a_last) = _per_image(grad), _per_image(x)
    if g_last and a_last:
        out = torch.mm(g.reshape(-1, g.shape[2]).t(), a.reshape(-1, a.shape[2]))
    else:
        wide = grad.is_cuda and grad.dtype in (torch.float16, torch.bfloat16)  # float32 accumulators out
        lhs, rhs = (g.transpose(1, 2) if g_last else g), (a if a_last else a.transpose(1, 2))
        out = (torch.bmm(lhs, rhs, out_dtype=torch.float32) if wide else torch.bmm(lhs, rhs)).sum(0)
    return out.to(grad.dtype).view(weight_shape)


def unfolded_weight_gradient(grad, x, weight_shape, stride, padding, dilation):
    """The weight gradient of a 2-d convolution over a thin input (one group, not transposed): the input's
    windows unfolded ([N, Cin·kh·kw, positions], no larger than the gradient when a window holds no more
    values than the output has channels), in the gradient's layout, then `pointwise_weight_gradient` over
    them. cuDNN pads such an input to 8 channels and ran U-Net's 3 -> 64 stem (8x64x64) as one split-K
    implicit GEMM of 232 µs on an H100."""
    return pointwise_weight_gradient(grad, _windows(x, weight_shape[2:], stride, padding, dilation, grad),
                                     (weight_shape[0], weight_shape[1] * math.prod(weight_shape[2:]), 1, 1)
                                     ).view(weight_shape)


def _windows(x, kernel, stride, padding, dilation, like):
    """x's windows as [N, C·kh·kw, Ho, Wo], in `like`'s layout (channels last or not): one copy of a
    strided view of the padded input (F.unfold launches an im2col kernel per image)."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, padding, dilation
    ho, wo = like.shape[2:]
    xp = torch.nn.functional.pad(x, (pw, pw, ph, ph)) if ph or pw else x
    s = xp.stride()
    view = xp.as_strided((n, c, kh, kw, ho, wo), (s[0], s[1], dh * s[2], dw * s[3], sh * s[2], sw * s[3]))
    if _stored_last(like):
        return view.permute(0, 4, 5, 1, 2, 3).reshape(n, ho, wo, c * kh * kw).permute(0, 3, 1, 2)
    return view.reshape(n, c * kh * kw, ho, wo)


def _per_image(t) -> tuple:
    """(t as [N, positions, C] with True where stored channels last, else as [N, C, positions] with
    False): views of a dense tensor in either layout, a copy otherwise."""
    n, c = t.shape[:2]
    if _stored_last(t):
        return t.movedim(1, -1).reshape(n, -1, c), True
    return t.contiguous().reshape(n, c, -1), False


def _stored_last(t) -> bool:
    """Dense with the channels (axis 1) innermost, and not also NCHW contiguous."""
    return t.movedim(1, -1).is_contiguous() and not t.is_contiguous()


# their readers of the gradient only look at the layout
LAYOUT_FREE = LAYOUT_FREE | {like_gradient, weight_like_gradient, pointwise_weight_gradient, unfolded_weight_gradient,
                             like_parameters}
# ...and of those, the ones that run faster when it is channels last: cuDNN, given an NCHW gradient, transposed it,
# the input and the weight to NHWC around each kernel and the result back (U-Net's backward: 36 such transposes)
CONVOLUTION_READERS = LAYOUT_FREE - {weights_channels_last, like_parameters}


def convolution_positions(call: fx.Node) -> frozenset:
    """The positions of a partition call's results (None: its single value) that a convolution (or a
    convolution's backward, or one of its operands' helpers above) reads. (The forward's saved
    activations are left to the forward's own choice: storing them channels last for the backward's
    sake made U-Net's group norms write across their row plans, 132 -> 368 µs of forward kernels
    against the 116 µs of `like_gradient` copies it saved.)"""
    def convolved(value: fx.Node) -> bool:
        return any(u.op == "call_function" and u.target in CONVOLUTION_READERS for u in value.users)

    items = [u for u in call.users if u.op == "call_function" and u.target is operator.getitem]
    if not items:
        return frozenset({None}) if convolved(call) else frozenset()
    return frozenset(item.args[1] for item in items if convolved(item))


def saved_weights_channels_last(gm: fx.GraphModule, saved_from: int | None) -> int:
    """In AOTAutograd's forward graph, for a target that runs convolutions channels last: each
    convolution weight (a graph input) that the graph also saves for the backward is converted to
    channels last once (`weights_channels_last`, all in one launch); the forward's convolutions read
    that copy and the backward gets it in the weight's place. Otherwise the forward converted it for
    cuDNN and the backward's convolution_backward converted it again (ResNet-18: 20 weights, 90 µs
    a step on an H100). Returns how many weights it converts."""
    if saved_from is None:
        return 0
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = _flat(output.args[0])
    saved = {v for v in outputs[saved_from:] if isinstance(v, fx.Node)}
    weights = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.convolution.default:
            w = node.args[1]
            if isinstance(w, fx.Node) and w.op == "placeholder" and w in saved and \
                    _channels_last_format(w.meta.get("val")) is not None:
                weights.setdefault(w, []).append(node)
    if not weights:
        return 0
    last_input = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last_input):
        copies = gm.graph.call_function(weights_channels_last, tuple(weights))
    converted = {}
    with gm.graph.inserting_after(copies):
        for k, (w, convolutions) in enumerate(weights.items()):
            converted[w] = gm.graph.call_function(operator.getitem, (copies, k))
            converted[w].meta["val"] = w.meta["val"]
            for conv in convolutions:
                conv.replace_input_with(w, converted[w])
    # the saved positions only: a weight the graph returns to the user keeps its layout
    swapped = [*outputs[:saved_from], *(converted.get(v, v) for v in outputs[saved_from:])]
    output.args = (type(output.args[0])(swapped),)
    gm.recompile()
    return len(converted)


@dataclass(frozen=True)
class DenseOrder:
    """A dense layout named by the order of its dims, outermost first: how a graph traced for dynamic shapes saw
    a tensor (its strides are symbolic), made concrete for each call's sizes."""

    dims: tuple[int, ...]

    def strides(self, shape) -> tuple[int, ...]:
        strides, step = [0] * len(shape), 1
        for d in reversed(self.dims):
            strides[d] = step
            step *= max(int(shape[d]), 1)
        return tuple(strides)

    def __str__(self) -> str:
        return f"dense, dims {self.dims} outermost first"


def traced_layout(value) -> tuple | DenseOrder | None:
    """The layout a graph was traced with for a value: its strides, or for symbolic strides of a dense layout the
    order of its dims (judged on the sizes Dynamo traced with); None for anything else."""
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return None
    stride = tuple(value.stride())
    if all(type(s) is int for s in stride):
        return stride
    hints, sizes = [_hint(s) for s in stride], [_hint(n) for n in value.shape]
    if None in hints or None in sizes or not _dense_layout(sizes, hints):
        return None
    return DenseOrder(tuple(sorted(range(len(stride)), key=lambda d: (-hints[d], d))))


def _hint(n) -> int | None:
    """The value a symbolic size or stride had where Dynamo traced (an int as it is), or None."""
    if type(n) is int:
        return n
    from torch.fx.experimental import symbolic_shapes
    hint = getattr(symbolic_shapes, "optimization_hint", None)
    try:
        return int(hint(n)) if hint is not None else int(n.node.hint)
    except Exception:  # an unbacked size (data-dependent): no hint
        return None


def restrided(t, stride):
    """`t` in `stride` (a copy), unless its layout already matches where it matters (dims of size > 1), or
    `stride` is not a dense layout of t's shape: an expanded tensor's zero strides (a mask broadcast over heads)
    hold one value for many elements, which t need not have; the graph's ops take t's layout as it is. A
    DenseOrder stands for the dense strides of t's shape in its order."""
    if isinstance(stride, DenseOrder) and isinstance(t, torch.Tensor):
        stride = stride.strides(t.shape)
    if stride is None or not isinstance(t, torch.Tensor) or all(
            a == b for n, a, b in zip(t.shape, t.stride(), stride) if n > 1) or not _dense_layout(t.shape, stride):
        return t
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


def _dense_layout(shape, stride) -> bool:
    """Do `stride` place every element of `shape` at its own address, with no gaps (a permutation of a
    contiguous layout)?"""
    expected = 1
    for size, step in sorted(((n, s) for n, s in zip(shape, stride) if n > 1), key=lambda d: d[1]):
        if step != expected:
            return False
        expected *= size
    return True


def channels_last_order(t) -> tuple[int, ...] | None:
    """The permutation that makes a tensor stored channels last contiguous (N, *spatial, C), or None
    where it is contiguous already or stored some other way."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.dim() < 3 or t.is_contiguous():
        return None
    perm = (0, *range(2, t.dim()), 1)
    return perm if t.permute(perm).is_contiguous() else None
