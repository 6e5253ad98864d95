"""A boolean attention mask turned into torch's own bias once a call, not once a layer.

torch's scaled_dot_product_attention takes a boolean mask and, for the kernel it picks, first turns it into an
additive bias (`where(mask, 0, fill)`), on every call: 12-13 µs a layer for OPT-125m's [4, 1, 1024, 1024] mask on
an H200, in every one of its 12 layers, though the layers share the mask. The fill depends on the kernel and on
the torch version (cuDNN's has been -65504, -1024 and -inf), and a query whose every key is masked gets a
different answer under each: only torch's own conversion keeps eager's answer.

So the conversion is read off torch itself: the attention call is traced once per signature (`make_fx`, which
decomposes scaled_dot_product_attention into the conversion and the kernel it picked for these operands), the
nodes computed from the mask alone are cut out as a function of the mask, and the bias they make is handed to
the later calls, which then pick the same kernel without converting anything (checked by tracing the call with
the bias: the same kernel, no conversion). Where the trace shows no conversion, or the bias would pick another
kernel, the boolean mask is kept.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import fx

log = logging.getLogger("stitchflow.gpu")

_CONVERSIONS: dict[tuple, fx.GraphModule | None] = {}  # signature -> the mask's conversion, or None: keep the mask


def conversion_for(query, key, value, mask: torch.Tensor, **kwargs) -> fx.GraphModule | None:
    """torch's conversion of `mask` for the attention kernel it picks for these operands (a function of the mask
    alone), or None where there is none to hoist. Traced at the first call of a signature, never during a CUDA
    graph's capture (the trace runs the attention once)."""
    signature = (*(_signature(t) for t in (query, key, value, mask)), tuple(sorted(kwargs.items())))
    if signature not in _CONVERSIONS:
        if query.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        _CONVERSIONS[signature] = _traced_conversion(query, key, value, mask, kwargs)
    return _CONVERSIONS[signature]


def _signature(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device)


def _traced_conversion(query, key, value, mask, kwargs) -> fx.GraphModule | None:
    from torch.fx.experimental.proxy_tensor import make_fx

    def attend(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, **kwargs)

    try:
        with torch.no_grad():
            traced = make_fx(attend)(query, key, value, mask)
            if not _converts(traced):
                return None
            conversion = _mask_part(traced)
            bias = conversion(mask)
            kernels = _kernels(traced)
            with_bias = make_fx(attend)(query, key, value, bias)
    except Exception as err:  # a torch that traces differently: the mask as it is, as before
        log.debug("attention mask: torch's conversion not traced (%s: %s)", type(err).__name__, err)
        return None
    if _converts(with_bias) or _kernels(with_bias) != kernels:
        log.debug("attention mask: a bias would change torch's kernel (%s -> %s)", kernels, _kernels(with_bias))
        return None
    return conversion


VIEWS = {"expand", "view", "_unsafe_view", "slice", "unsqueeze", "squeeze", "as_strided", "alias", "permute", "t",
         "select", "detach", "reshape"}


def _converts(gm: fx.GraphModule) -> bool:
    """Whether torch computes something from the mask before its kernel (views of it, such as memory-efficient
    attention's bias expanded over the heads, cost nothing and are not a conversion)."""
    part = _mask_part(gm)
    return part is not None and any(n.op == "call_function" and _op_name(n) not in VIEWS for n in part.graph.nodes)


def _op_name(n: fx.Node) -> str:
    return getattr(n.target, "__name__", str(n.target)).split(".")[0]


def _kernels(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "attention" in str(n.target)]


def _mask_part(gm: fx.GraphModule) -> fx.GraphModule | None:
    """The nodes computed from the mask alone (and constants), ending at the one value that the rest reads, as a
    function of the mask; None where the rest reads the mask itself (nothing converts it) or several of them."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    mask = placeholders[3]
    derived = {mask}
    for n in gm.graph.nodes:
        if n.op == "call_function" and all(a in derived for a in n.all_input_nodes) and \
                (n.all_input_nodes or _is_constant(n)):
            derived.add(n)
    # a constant made with no input belongs to the mask part only where something derived from the mask reads it
    frontier = [n for n in derived if any(u not in derived for u in n.users)]
    if len(frontier) != 1 or frontier[0] is mask:
        return None
    graph = fx.Graph()
    env = {mask: graph.placeholder("mask")}
    for n in gm.graph.nodes:
        if n in derived and n is not mask and _needed(n, frontier[0]):
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(env[frontier[0]])
    return fx.GraphModule(gm, graph)


def _is_constant(n: fx.Node) -> bool:
    return n.target in (torch.ops.aten.scalar_tensor.default, torch.ops.aten.full.default)


def _needed(n: fx.Node, end: fx.Node) -> bool:
    """Whether `end` depends on `n`."""
    todo, seen = [end], set()
    while todo:
        m = todo.pop()
        if m is n:
            return True
        if m not in seen:
            seen.add(m)
            todo += m.all_input_nodes
    return False
