"""Attention written out as products and a softmax, found in a Dynamo graph and rewritten into
`F.scaled_dot_product_attention` before AOTAutograd traces it (the training path, training.py).

Models often spell attention as `softmax(q @ k.transpose(-2, -1) * scale + mask) @ v` (the Llama
and BERT blocks of the app zoo do). In inference the IR finds that pattern itself (the gpu target's
attention, planned per mask). In training AOTAutograd decomposes it first, and its backward then
materialises the [heads, S, S] scores' gradient: for a Llama block at S = 2048 the forward and
backward each write and read several 256 MB score tensors, where torch's flash attention (and its
backward) keeps them on chip. Inductor does not rewrite this spelling either (its fuse_attention
patterns miss a scale by multiplication, a broadcast GQA head axis and a buffer mask).

Matched (`find`): a softmax over the last axis (or one computed in float32 over 16-bit scores and
cast back, as Hugging Face's eager attention writes it) whose one reader, through a dropout of p = 0
at most, is a product with V; before it, optionally an additive mask (or `masked_fill` with -inf),
optionally a scale by a number, and a product of Q with K's last two axes swapped. Refused, each
with its reason (`Refusal`): any intermediate read elsewhere (the scores stay needed), dropout
with p > 0 (torch's kernels would draw other random numbers than eager's), a mask of another dtype
or one that varies over batch axes the 4-d call must merge, a softmax in another dtype.

A mask computed from module buffers and constants alone (a buffer itself, as the app zoo's Llama
holds it, or nanoGPT's `masked_fill(bias[..., :T, :T] == 0, -inf)`) that hides exactly the keys
after each query becomes `is_causal=True`, which lets torch run its flash kernels (`rewritten`
leaves any other mask as written by default: torch's masked kernel was slower than the stitched
scores). It is computed and checked on the example inputs at compile time, and again on every call
whose buffers are other tensors or have been written since (`CausalGuard`, from their addresses and
version counters).

Numerics: torch's kernels keep the scores in float32 where eager rounds them to the inputs'
dtype (bf16) after each op, so results differ from eager's by about eager's own rounding error.
A row whose keys are all masked gives NaN eagerly and 0 here (as torch's SDPA)."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

_SOFTMAX = ({torch.softmax, F.softmax, torch.special.softmax}, {"softmax"})
_MATMUL = ({operator.matmul, torch.matmul}, {"matmul", "__matmul__"})
_MUL = ({operator.mul, torch.mul}, {"mul", "__mul__"})
_DIV = ({operator.truediv, torch.div, torch.true_divide}, {"div", "__truediv__", "true_divide"})
_ADD = ({operator.add, torch.add}, {"add", "__add__"})
_TRANSPOSE = ({torch.transpose, torch.swapaxes, torch.swapdims}, {"transpose", "swapaxes", "swapdims"})
_MASKED_FILL = ({torch.masked_fill}, {"masked_fill"})
_DROPOUT = ({F.dropout, torch.dropout}, set())
_CAST = (set(), {"to", "type", "type_as", "bfloat16", "half"})


@dataclass(frozen=True)
class Attention:
    """One matched attention: out = softmax(q @ k^T * scale + mask) @ v."""
    out: fx.Node                  # the product with V, whose readers the rewrite takes over
    q: fx.Node
    k: fx.Node
    v: fx.Node
    scale: float
    mask: fx.Node | None          # additive (float) or, from masked_fill, the positions filled (bool)
    filled: bool                  # mask came from masked_fill: True where the key is left out
    causal: CausalMask | None     # the mask, where it is found causal
    chain: tuple[fx.Node, ...]    # the nodes the rewrite makes dead, last first

    @property
    def softmax(self) -> fx.Node:
        return next(n for n in self.chain if _is(n, _SOFTMAX))

    def __str__(self) -> str:
        how = "causal" if self.causal is not None else ("masked" if self.mask is not None else "unmasked")
        return f"attention {self.out.name} = softmax({self.q.name} @ {self.k.name}^T * {self.scale:.4g}) @ {self.v.name} ({how})"


@dataclass(frozen=True)
class Refusal:
    node: fx.Node
    reason: str

    def __str__(self) -> str:
        return f"softmax {self.node.name} stays as written: {self.reason}"


class NoMatch(Exception):
    """Raised inside the matcher with the reason a softmax is not an attention's."""


def _is(node, table) -> bool:
    fns, methods = table
    return isinstance(node, fx.Node) and (
        (node.op == "call_function" and node.target in fns) or (node.op == "call_method" and node.target in methods))


def example_value(node):
    """The example value Dynamo recorded for `node` (a fake tensor), or None."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("example_value", node.meta.get("val"))
    return val if isinstance(val, torch.Tensor) else None


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _only_reader(node: fx.Node, what: str) -> fx.Node:
    if len(node.users) != 1:
        raise NoMatch(f"{what} {node.name} is read {len(node.users)} times (the scores would still be needed)")
    return next(iter(node.users))


def _softmax_axis_is_last(node: fx.Node) -> None:
    x = example_value(node.args[0]) if node.args else None
    dim = _arg(node, 1, "dim")
    if x is None or not isinstance(dim, int):
        raise NoMatch("the softmax's axis or input shape is unknown")
    if dim not in (-1, x.dim() - 1):
        raise NoMatch(f"softmax over axis {dim} of {x.dim()}, not the last")


def _upcast(node: fx.Node) -> bool:
    """Is `node` a softmax computed in float32 over 16-bit scores (`softmax(s, dim=-1, dtype=torch.float32)`,
    as Hugging Face's eager attention writes it)? Raises NoMatch for any other dtype."""
    dtype = _arg(node, 3 if node.target is F.softmax else 2, "dtype")
    if dtype is None:
        return False
    x = example_value(node.args[0])
    if dtype != torch.float32 or x.dtype not in (torch.float16, torch.bfloat16):
        raise NoMatch(f"softmax of {x.dtype} scores computed in {dtype}")
    return True


def _through_dropout(node: fx.Node, upcast: bool) -> tuple[fx.Node, list[fx.Node]]:
    """The reader of the probabilities past a cast back to the scores' dtype (`upcast`: the softmax ran in
    float32) and a dropout that keeps them as they are, and the nodes passed."""
    reader = _only_reader(node, "the softmax")
    passed = []
    if upcast:
        back = example_value(reader)
        if not (_is(reader, _CAST) and back is not None and back.dtype == example_value(node.args[0]).dtype):
            raise NoMatch("the float32 probabilities are not cast back to the scores' dtype")
        passed.append(reader)
        reader = _only_reader(reader, "the cast")
    if _is(reader, _DROPOUT):
        p, training = _arg(reader, 1, "p", 0.5), _arg(reader, 2, "training" if reader.target is F.dropout else "train", True)
        if not isinstance(p, (int, float)) or not isinstance(training, bool):
            raise NoMatch("a dropout whose rate is not a constant")
        if p != 0 and training:
            raise NoMatch(f"dropout with p={p} in training (torch's attention would draw other random numbers)")
        passed.append(reader)
        reader = _only_reader(reader, "the dropout")
    return reader, passed


def _number(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _split_mask(node: fx.Node) -> tuple[fx.Node, fx.Node | None, bool]:
    """(scores, mask, filled): the softmax's input taken apart at an additive mask or a masked_fill."""
    if _is(node, _ADD) and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        for scores, mask in ((a, b), (b, a)):
            if _is(scores, _MATMUL) or _is(scores, _MUL) or _is(scores, _DIV):
                if isinstance(mask, fx.Node):
                    return scores, mask, False
        raise NoMatch(f"{node.name} adds no tensor mask to a product")
    if _is(node, _MASKED_FILL):
        scores, mask, fill = _arg(node, 0, "input"), _arg(node, 1, "mask"), _arg(node, 2, "value")
        if _number(fill) is None or not (fill == -math.inf or (example_value(scores) is not None and
                                                               fill <= torch.finfo(example_value(scores).dtype).min)):
            raise NoMatch(f"masked_fill with {fill!r}, not -inf")
        return scores, mask, True
    return node, None, False


def _split_scale(node: fx.Node) -> tuple[fx.Node, float]:
    if _is(node, _MUL) and len(node.args) == 2:
        a, b = node.args
        if _number(b) is not None:
            return a, _number(b)
        if _number(a) is not None:
            return b, _number(a)
    if _is(node, _DIV) and len(node.args) == 2 and not node.kwargs and _number(node.args[1]):
        return node.args[0], 1.0 / _number(node.args[1])
    return node, 1.0


def _last_axes_swapped(node: fx.Node) -> fx.Node:
    """K, from K with its last two axes swapped."""
    val = example_value(node)
    if _is(node, _TRANSPOSE) and val is not None:
        d0, d1 = _arg(node, 1, "dim0"), _arg(node, 2, "dim1")
        n = val.dim()
        if isinstance(d0, int) and isinstance(d1, int) and {d0 % n, d1 % n} == {n - 2, n - 1}:
            return node.args[0]
    if node.op == "call_function" and node.target is getattr and node.args[1] == "mT":
        return node.args[0]
    raise NoMatch(f"{node.name} is not K with its last two axes swapped")


def _chain_nodes(*nodes) -> tuple[fx.Node, ...]:
    return tuple(n for n in nodes if isinstance(n, fx.Node))


def match(softmax: fx.Node, example_inputs=None) -> Attention:
    """The attention around `softmax`; raises NoMatch with the reason it is none."""
    _softmax_axis_is_last(softmax)
    out, passed = _through_dropout(softmax, _upcast(softmax))
    if not (_is(out, _MATMUL) and len(out.args) == 2 and out.args[0] is (passed[-1] if passed else softmax)):
        raise NoMatch("the probabilities are not multiplied by V")
    _only_reader(softmax.args[0], "the softmax's input")
    scores, mask, filled = _split_mask(softmax.args[0])
    if mask is not None:
        _only_reader(scores, "the scores")
    product, scale = _split_scale(scores)
    if product is not scores:
        _only_reader(product, "the product q @ k^T")
    if not _is(product, _MATMUL) or len(product.args) != 2:
        raise NoMatch("the scores are not a product q @ k^T")
    q, kt = product.args
    k = _last_axes_swapped(kt)
    v = out.args[1]
    _check_shapes(q, k, v, mask, filled)
    chain = _chain_nodes(*passed[::-1], softmax, softmax.args[0] if mask is not None else None,
                         scores if scores is not product else None, product)
    causal = _causal_mask(mask, filled, q, k, example_inputs)
    return Attention(out, q, k, v, scale, mask, filled, causal, chain)


def _check_shapes(q, k, v, mask, filled) -> None:
    vq, vk, vv = example_value(q), example_value(k), example_value(v)
    if vq is None or vk is None or vv is None:
        raise NoMatch("q, k or v has no recorded shape")
    if not (vq.dim() == vk.dim() == vv.dim() >= 3):
        raise NoMatch(f"q, k and v of ranks {vq.dim()}, {vk.dim()}, {vv.dim()} (equal ranks of 3 or more are rewritten)")
    if not (vq.dtype == vk.dtype == vv.dtype and vq.is_floating_point()):
        raise NoMatch(f"q, k and v of dtypes {vq.dtype}, {vk.dtype}, {vv.dtype}")
    if vq.shape[-1] != vk.shape[-1] or vk.shape[-2] != vv.shape[-2]:
        raise NoMatch("q, k and v's last axes do not chain")
    batch = torch.broadcast_shapes(vq.shape[:-2], vk.shape[:-2], vv.shape[:-2])
    if tuple(batch) != tuple(vq.shape[:-2]):
        raise NoMatch("q's batch axes are broadcast against k's or v's")
    vm = example_value(mask)
    if mask is not None:
        if vm is None:
            raise NoMatch("the mask has no recorded shape")
        want = torch.bool if filled else vq.dtype
        if vm.dtype != want:
            raise NoMatch(f"a mask of dtype {vm.dtype} against scores of {vq.dtype}")
        if vm.dim() > vq.dim():
            raise NoMatch("the mask has more axes than the scores")
        padded = (1,) * (vq.dim() - vm.dim()) + tuple(vm.shape)
        if len(batch) > 2 and any(s != 1 for s in padded[1:len(batch)]):
            raise NoMatch("the mask varies over batch axes that the 4-d call merges into its head axis")


@dataclass(frozen=True)
class CausalMask:
    """A mask found causal on the example inputs, and how to check it again: `evaluate` computes it from
    the graph's inputs at `positions` (module buffers or parameters; none where it is made from constants)."""
    positions: tuple[int, ...]
    evaluate: fx.GraphModule
    filled: bool                  # a masked_fill's positions (True above the diagonal), else additive
    size: int

    def holds(self, inputs) -> bool:
        return is_causal(self.evaluate(*inputs), self.size, self.filled)


MASK_NODES_MOST = 24  # a mask computed by more nodes than this is not evaluated at compile time
_DRAWS = ("rand", "bernoulli", "dropout", "normal", "multinomial", "poisson")


def _causal_mask(mask, filled, q, k, example_inputs) -> CausalMask | None:
    """`mask` as a CausalMask where it is computed from module buffers and constants alone and is causal on
    the example inputs; None otherwise."""
    if mask is None or example_inputs is None:
        return None
    size = example_value(q).shape[-2]
    nodes = _mask_nodes(mask)
    if nodes is None or size != example_value(k).shape[-2]:
        return None
    placeholders = [n for n in mask.graph.nodes if n.op == "placeholder"]
    sources = [n for n in nodes if n.op == "placeholder"]
    positions = tuple(placeholders.index(n) for n in sources)
    if any(p >= len(example_inputs) or not _static(example_inputs[p]) for p in positions):
        return None
    graph, env = fx.Graph(), {}
    for node in nodes:
        env[node] = graph.placeholder(node.name) if node.op == "placeholder" else graph.node_copy(node, env.__getitem__)
    graph.output(env[mask])
    found = CausalMask(positions, fx.GraphModule(mask.graph.owning_module, graph), filled, size)
    try:
        return found if found.holds([example_inputs[p] for p in positions]) else None
    except Exception:  # whatever the mask's ops do on these inputs, it is then no causal mask we know
        return None


def _mask_nodes(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes `mask` is computed from, in graph order, when they are graph inputs, attributes and
    deterministic ops without side effects (at most MASK_NODES_MOST); None otherwise."""
    seen, todo = set(), [mask]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op not in ("placeholder", "get_attr", "call_function", "call_method") or len(seen) > MASK_NODES_MOST:
            return None
        name = str(getattr(node.target, "__name__", node.target))
        in_place = name.endswith("_") and not name.startswith("__")  # masked_fill_, not __eq__
        if node.op.startswith("call") and (in_place or any(word in name for word in _DRAWS)):
            return None  # in place, or random
        todo += node.all_input_nodes
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _static(tensor) -> bool:
    """A module's parameter or buffer (Dynamo marks those it lifts to inputs), not an activation that changes
    every call: checking it again by value would then cost a device sync each call."""
    return isinstance(tensor, torch.Tensor) and (isinstance(tensor, torch.nn.Parameter) or
                                                 getattr(tensor, "_dynamo_static_input_type", None) is not None)


def is_causal(mask: torch.Tensor, size: int, filled: bool = False) -> bool:
    """Does `mask` (any leading axes of 1) hide exactly the keys after each query of a [size, size] square?
    Additive: -inf, or its dtype's lowest value, above the diagonal and 0 on and below it. `filled` (the
    positions a masked_fill sets to -inf): True above the diagonal, False on and below it."""
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (size, size) or any(s != 1 for s in mask.shape[:-2]):
        return False
    square = mask.reshape(size, size)
    above = torch.ones(size, size, dtype=torch.bool, device=mask.device).triu(1)
    if filled:
        return mask.dtype == torch.bool and torch.equal(square, above)
    if not mask.is_floating_point() or bool((square[~above] != 0).any()):
        return False
    high = square[above]
    return bool(((high == -math.inf) | (high == torch.finfo(mask.dtype).min)).all())


def find(gm: fx.GraphModule, example_inputs=None) -> tuple[list[Attention], list[Refusal]]:
    """Every attention of `gm`, and every softmax that is none with the reason."""
    found, refused = [], []
    for node in gm.graph.nodes:
        if _is(node, _SOFTMAX):
            try:
                found.append(match(node, example_inputs))
            except NoMatch as why:
                refused.append(Refusal(node, str(why)))
    return found, refused


def _plain_sizes(*nodes) -> bool:
    return all(isinstance(s, int) for n in nodes if n is not None for s in example_value(n).shape)


def _to_4d(graph: fx.Graph, node: fx.Node, batch: tuple, expand: bool) -> fx.Node:
    """`node` ([*b, S, D], b broadcastable to `batch`) as the 4-d [B, H, S, D] torch's attention takes."""
    shape = tuple(example_value(node).shape)
    rows = shape[-2:]
    if expand and shape[:-2] != batch:
        node = graph.call_method("expand", (node, *batch, *rows))
    if len(batch) == 1:
        return graph.call_method("unsqueeze", (node, 0))
    if len(batch) == 2:
        return node
    return graph.call_method("reshape", (node, batch[0], math.prod(batch[1:]), *rows))


def _mask_4d(graph: fx.Graph, mask: fx.Node, shape: tuple, batch: tuple) -> fx.Node:
    padded = (1,) * (len(batch) + 2 - len(shape)) + shape
    if len(batch) == 1:
        return graph.call_method("reshape", (mask, 1, *padded))
    if len(batch) == 2:
        return graph.call_method("reshape", (mask, *padded))
    return graph.call_method("reshape", (mask, padded[0], 1, *padded[-2:]))


def _grouped(att: Attention) -> bool:
    """Grouped query heads that torch's flash kernel reads in place (enable_gqa): q (B, KV, G, S, D)
    against k and v (B, KV, 1, S, D), in 16 bits. Elsewhere (float32, explicit masks) torch would run its
    math kernel for enable_gqa, so k and v are expanded to every head instead (a copy of each)."""
    vq, vk, vv = (example_value(t) for t in (att.q, att.k, att.v))
    return (vq.dim() == 5 and vq.dtype in (torch.float16, torch.bfloat16) and vq.shape[-1] <= 256
            and tuple(vk.shape[:-2]) == tuple(vv.shape[:-2]) == (*vq.shape[:2], 1))


def rewrite(gm: fx.GraphModule, att: Attention, causal: bool = True) -> None:
    """Replace `att` in `gm.graph` by one F.scaled_dot_product_attention (in place; recompile after).
    `causal=False` passes a mask found causal as the mask it is."""
    graph = gm.graph
    vq, vv = example_value(att.q), example_value(att.v)
    batch = tuple(vq.shape[:-2])
    kwargs: dict = {"scale": att.scale}
    is_causal = att.causal is not None and causal
    with graph.inserting_before(att.out):
        if (att.mask is None or is_causal) and _grouped(att):
            q = graph.call_method("reshape", (att.q, batch[0], batch[1] * batch[2], *vq.shape[-2:]))
            k, v = (graph.call_method("squeeze", (t, 2)) for t in (att.k, att.v))
            kwargs["enable_gqa"] = True
        else:
            q, k, v = (_to_4d(graph, att.q, batch, False), _to_4d(graph, att.k, batch, True),
                       _to_4d(graph, att.v, batch, True))
        if is_causal:
            kwargs["is_causal"] = True
        elif att.mask is not None:
            mask = graph.call_function(torch.logical_not, (att.mask,)) if att.filled else att.mask
            kwargs["attn_mask"] = _mask_4d(graph, mask, tuple(example_value(att.mask).shape), batch)
        out = graph.call_function(F.scaled_dot_product_attention, (q, k, v), kwargs)
        if len(batch) != 2:
            out = graph.call_method("reshape", (out, *batch, vq.shape[-2], vv.shape[-1]))
    att.out.replace_all_uses_with(out)
    kt = att.chain[-1].args[1]
    for node in (att.out, *att.chain):
        graph.erase_node(node)
    if not kt.users:
        graph.erase_node(kt)


MASKED_SLOWER = ("an explicit mask takes torch's memory-efficient kernel, slower in training than the "
                 "stitched scores on an H100 (BERT block 277 against 250 µs); options {'attention': 'masked'} "
                 "rewrites it anyway")


def rewritten(gm: fx.GraphModule, example_inputs=None, causal: bool = True, masked: bool = False
              ) -> tuple[fx.GraphModule, list[Attention], list[Refusal]]:
    """A copy of `gm` with its attentions rewritten (`gm` itself is left as it is): those without a mask
    and those whose mask is causal (`causal`), and with `masked` those with any other mask too."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copy = fx.GraphModule(gm, graph)
    found, refused = find(copy, example_inputs)
    done = []
    for att in found:
        if not _plain_sizes(att.q, att.k, att.v, att.mask):
            refused.append(Refusal(att.softmax, "symbolic sizes (the 4-d call is built from plain ones)"))
            continue
        if att.mask is not None and not (causal and att.causal is not None) and not masked:
            refused.append(Refusal(att.softmax, MASKED_SLOWER))
            continue
        rewrite(copy, att, causal)
        done.append(att)
    if done:
        copy.graph.lint()
        copy.recompile()
    return copy, done, refused


class CausalGuard:
    """Calls `fast` (compiled with the masks found causal as is_causal=True) while each such mask is still
    causal: the inputs it is computed from are known by their addresses and version counters (which every
    in-place write bumps), or the mask is computed and checked again (a device sync, once per new tensor
    or write). Once one is not causal, calls the graph compiled with its masks as masks (`build_general()`)
    from then on."""

    def __init__(self, fast, masks: list[CausalMask], example_inputs, build_general):
        self.fast, self.masks, self.build_general = fast, [m for m in masks if m.positions], build_general
        self.general = None
        self.seen = {_identity(m, example_inputs) for m in self.masks}

    def __call__(self, *args):
        if self.general is None and all(self._holds(m, args) for m in self.masks):
            return self.fast(*args)
        if self.general is None:
            self.general = self.build_general()
        return self.general(*args)

    def _holds(self, mask: CausalMask, args) -> bool:
        key = _identity(mask, args)
        if key in self.seen:
            return True
        try:
            ok = key is not None and mask.holds([args[p] for p in mask.positions])
        except Exception:
            ok = False
        if ok:
            self.seen.add(key)
        return ok


def _identity(mask: CausalMask, args) -> tuple | None:
    tensors = [args[p] for p in mask.positions]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    return id(mask), *((t.data_ptr(), t._version, tuple(t.shape), t.dtype) for t in tensors)
