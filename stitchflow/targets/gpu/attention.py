"""Attention regions in the IR: recognise softmax(t(Q·Kᵀ))·V, fold its mask into tiles, run one kernel.

    matches, refusals = match_attention(graph, params)  # attention_match.py: AttentionMatch(scores .. output)
    step = AttentionStep(graph, match, params, options)   # folds the mask; step(env) writes the output node

A match is a contraction S[b..., l, m] = sum_d Q·K, a run of elementwise nodes over S whose other
inputs are constants of the program indexed by (l, m) at most (a 0/1 or BSR mask, a scale, an
additive bias, a masked_fill; nodes computed from parameters alone count as constants) and at most
one tensor of the call indexed by batch axes and the key (a padding mask), the four nodes of a
softmax over m, and a contraction O[b..., l, e] = sum_m P·V. The elementwise run is evaluated at
compile time over the (l, m) grid for a few values of the score s and the key bias r: if it is
a·s + b[l, m] + c·r with one a and one c, and -inf where the mask drops the position, the whole
score transform is one map b and two scalars, and `attention_kernel.tile_plan` cuts b into the
tiles the kernel visits. The mask's sparsity becomes skipped work, whatever format it was stored
in. Anything else (a mask per head, a soft cap, a non-0/1 multiplicative mask) is refused with its
reason and runs as before: the contractions through torch, the rest as stitched kernels.
"""

from __future__ import annotations

import logging
import math
from dataclasses import astuple

import torch

from ...ir.expr import Access
from ...ir.graph import Graph
from ...ir.index import Div, affine_terms
from ...ir.interpret import eval_node
from .attention_kernel import Operand, launch, scratch
from .attention_fold import NotAttention, score_coefficients, transform_sources
from .attention_match import AttentionMatch
from .attention_plan import AttentionTiles, TilePlan, chunk_options, tile_plan
from .emit import contiguous_strides
from .layout import Store
from .library_mask import conversion_for
from .runtime import interpreting, load_choice, save_choice

log = logging.getLogger("stitchflow.gpu.attention")


# ---------------------------------------------------------------- running

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_FEATURES = 256
DEFAULT_TILES = AttentionTiles(64, 64, 4, 2)
INTERPRETER_TILES = AttentionTiles(32, 32, 4, 1)
# torch's scaled_dot_product_attention (its flash, cuDNN or memory-efficient kernel), timed beside our tiles
# where it computes the same thing: dense attention runs faster there than our block-sparse kernel
LIBRARY = AttentionTiles(0, 0, 0, 0, 0)
MAX_LIBRARY_MASK = 1 << 24  # positions of a mask the library is given densely (64 MB of float32)
# Tile configs the autotuner times, by operand width and head dim: each compiles for sm_90 without
# spilling (tests/targets/gpu/test_attention.py checks them all; at head dim 128 the 4-warp tiles and
# bm128 x bn128 spill, and fp32's exact dot takes register-hungry FMA code)
CANDIDATES = {
    (16, 64): ((128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2),
               (64, 128, 4, 2), (128, 32, 4, 3), (128, 32, 8, 3), (64, 32, 4, 2)),
    (16, 128): ((128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 8, 2), (64, 32, 8, 2)),
    (32, 64): ((32, 32, 4, 2), (64, 32, 8, 2), (32, 64, 8, 2)),
    (32, 128): ((32, 32, 8, 2),),
}


SPILL_WITH_KEY_BIAS = {(128, 128, 8, 2), (64, 128, 4, 2)}  # 8-16 bytes each at head dim 64
SPILL_SPLIT_WITH_KEY_BIAS = {(128, 64, 8, 3), (128, 64, 8, 2)}  # split runs, head dim 128: 32 bytes each
FP32_OFFSETS_ONLY = {(128, 128, 8, 2)}  # bf16 offsets spill 1.8 KB there (the other shapes 0-930 bytes)


def narrow_offsets(dtype: torch.dtype, head_dim: int, tiles: AttentionTiles) -> bool:
    """Whether partial tiles take bf16 offsets (attention_plan.tile_plan's `narrow`): 16-bit operands at head
    dim 64 or less, except the shapes where they spill too much."""
    return dtype != torch.float32 and head_dim <= 64 and astuple(tiles)[:4] not in FP32_OFFSETS_ONLY


def candidates(dtype: torch.dtype, head_dim: int, key_bias: bool = False) -> tuple[AttentionTiles, ...]:
    width = 32 if dtype == torch.float32 else 16
    shapes = CANDIDATES[width, 64 if head_dim <= 64 else 128]
    return tuple(AttentionTiles(*t) for t in shapes if not (key_bias and t in SPILL_WITH_KEY_BIAS))


def _strided(op: Operand, batch: tuple, length: int, width: int) -> torch.Tensor:
    """The operand as a tensor [batch..., length, width] (a view: no copy)."""
    return op.tensor.as_strided((*batch, length, width), (*op.batch_strides, op.seq_stride, op.feature_stride),
                                op.tensor.storage_offset() + op.offset)


SHARED_MASK = "attention mask of the call "  # the environment's key prefix for a mask shared by the layers


def _as_library_bias(env: dict, shared: str, mask: torch.Tensor, views, **kwargs) -> torch.Tensor:
    """The call's boolean mask as the bias torch's attention would make of it for these operands, made once a call
    and shared by the layers of the same operands (library_mask.py); the mask itself where torch makes none."""
    key = f"{shared}:bias:{[(tuple(v.shape), tuple(v.stride()), v.dtype) for v in views]}:{sorted(kwargs.items())}"
    if key not in env:
        env[key] = _library_bias(mask, views, **kwargs)
    return env[key]


def _library_bias(mask: torch.Tensor, views, **kwargs) -> torch.Tensor:
    conversion = conversion_for(*views, mask, **kwargs) if mask.dtype == torch.bool else None
    return conversion(mask) if conversion is not None else mask


def _broadcast(mask: torch.Tensor) -> torch.Tensor:
    """The mask with its stride-0 axes (a mask shared by every head) at size 1: torch's attention broadcasts it, and
    a mask of full size is converted to an additive bias of full size on every call."""
    for axis, stride in enumerate(mask.stride()[:-2]):
        if stride == 0:
            mask = mask.narrow(axis, 0, 1)
    return mask


class AttentionStep:
    """One attention match as one kernel launch; tiles autotuned on the device at the first call."""

    def __init__(self, graph: Graph, match: AttentionMatch, params: dict, options: dict,
                 store: Store | None = None):
        """`store` (layout.output_store): the output written through strides as a view of a contiguous
        buffer, the result of the copy node that only reorders it (the heads merged; that node then never
        runs) or a buffer laid out as the output's reader walks it."""
        self.graph, self.match, self.options = graph, match, dict(options or {})
        self.store = store
        self.nodes = match.nodes + ((store.into,) if store and store.into else ())  # in graph order
        node_of, type_of = graph.node_of, graph.type_of
        scores, out = node_of[match.scores], node_of[match.output]
        dtypes = [type_of[a.tensor].dtype for a in (match.q, match.k, match.v)]
        if dtypes[0] != dtypes[1] or any(dt not in FLOAT_DTYPES for dt in dtypes):
            raise NotAttention(f"Q, K, V are {[str(dt) for dt in dtypes]}: Q and K must share a float dtype")
        *self.batch_vars, self.l_var, self.m_var = scores.out_vars
        self.d_var = scores.reduce_vars[0]
        *self.out_batch_vars, _, self.e_var = out.out_vars
        self.r_var = out.reduce_vars[0]
        ext = scores.extents
        self.groups = match.groups or (1,) * len(self.batch_vars)
        # a grouped axis h walks as (h // G, h % G): the heads of one group read one K and V
        self.batch = tuple(e for v, g in zip(self.batch_vars, self.groups) for e in ((ext[v] // g, g) if g > 1
                                                                                      else (ext[v],)))
        self.s_q, self.s_k, self.d = ext[self.l_var], ext[self.m_var], ext[self.d_var]
        self.dv = out.extents[self.e_var]
        if max(self.d, self.dv) > MAX_FEATURES:
            raise NotAttention(f"head dims {self.d}, {self.dv} exceed {MAX_FEATURES}")
        self.out_type = type_of[match.result]
        self.q_dtype = dtypes[0]
        self.params = params
        self.sources = transform_sources(graph, match, params)
        self.versions = self._versions()
        self.coefficients = score_coefficients(graph, match, params)
        self.key = (f"attention-split:{self.coefficients[1].digest()}:{self.coefficients[0]!r}:"
                    f"{self.batch}x{self.s_q}x{self.s_k}:"
                    f"{self.d}x{self.dv}:{dtypes[0]}->{self.out_type.dtype}")
        kept = self.coefficients[1].kept / (self.s_q * self.s_k)
        log.info("%s: mask folded, %.1f%% of the score positions kept", match, 100 * kept)
        self.plans: dict = {}
        self._library: tuple | None = None  # (the coefficients it was worked out from, library_form())
        # (those coefficients, {key: the constant mask on a device, or torch's bias of it for given operands})
        self._library_masks: tuple = (None, {})
        if match.call_mask is not None and self.library_form() is None:
            raise NotAttention(f"{match.output}'s mask of the call goes to torch's attention, which cannot take "
                               "this match (an output dtype other than Q's, or offsets too large to hand over)")
        self.chosen: AttentionTiles | None = None
        self.tuned_us: float | None = None

    def _versions(self) -> dict[str, int]:
        return {name: t._version for name, t in self.sources.items()}

    def _refold_if_changed(self) -> None:
        """The mask was folded into tiles when compiled; if a parameter it comes from has been
        written in place since (a torch.compile partition binds buffers by reference), fold again."""
        versions = self._versions()
        if versions != self.versions:
            log.info("%s: %s changed in place, folding the mask again", self.match,
                     [n for n in versions if versions[n] != self.versions.get(n)])
            self.coefficients = score_coefficients(self.graph, self.match, self.params)
            self.plans.clear()
            self.versions = versions

    # -- operands

    def _operand(self, access: Access, env, batch_vars, seq_var: str, feature_var: str) -> Operand:
        t = env[access.tensor]
        coef, grouped, offset = {}, {}, 0
        for index, stride in zip(access.indices, t.stride()):
            terms, const = affine_terms(index)
            offset += const * stride
            for atom, c in terms.items():
                into = grouped if isinstance(atom, Div) else coef
                name = atom.arg.name if isinstance(atom, Div) else atom.name
                into[name] = into.get(name, 0) + c * stride
        batch = []  # h = G·o + i: c·h + c'·(h // G) = (G·c + c')·o + c·i
        for v, g in zip(batch_vars, self.groups):
            plain = coef.get(v, 0)
            batch += [g * plain + grouped.get(v, 0), plain] if g > 1 else [plain]
        return Operand(t, offset, tuple(batch), coef.get(seq_var, 0), coef.get(feature_var, 0))

    def _library_view(self, op: Operand, length: int, width: int, shared: bool = False) -> torch.Tensor:
        """The operand as torch's attention takes it: [batch..., length, width], a grouped last batch axis whole
        for Q (its stride the inner one) and in groups for K and V (enable_gqa: H // G heads, the outer stride)."""
        if self.groups[-1] == 1:
            return _strided(op, self.batch, length, width)
        *lead, outer, inner = op.batch_strides
        heads = self.batch[-2] * (1 if shared else self.batch[-1])
        return op.tensor.as_strided((*self.batch[:-2], heads, length, width),
                                    (*lead, outer if shared else inner, op.seq_stride, op.feature_stride),
                                    op.tensor.storage_offset() + op.offset)

    def _grouped_view(self, t: torch.Tensor) -> torch.Tensor:
        """An output [batch..., l, e] as the kernel walks it, each grouped axis split in two."""
        for axis in reversed([k for k, g in enumerate(self.groups) if g > 1]):
            t = t.unflatten(axis, (t.shape[axis] // self.groups[axis], self.groups[axis]))
        return t

    def _plan(self, tiles: AttentionTiles, device) -> TilePlan:
        key = (tiles, str(device))
        if key not in self.plans:
            narrow = narrow_offsets(self.q_dtype, max(self.d, self.dv), tiles)
            self.plans[key] = tile_plan(*self.coefficients[:2], tiles, narrow).to(device)
        return self.plans[key]

    def _precision(self, dtype) -> str:
        if dtype != torch.float32 or interpreting():
            return "ieee"
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"

    def library_form(self) -> tuple[bool, torch.Tensor | None] | None:
        """(is_causal, mask or None) with which torch's scaled_dot_product_attention computes this match
        (the scale is the scores' factor); None where it cannot: a key bias, an output dtype other than Q's,
        a mask too large to hand over densely. The mask is boolean where the offsets are all 0 or -inf.
        Worked out once per fold (it walks the whole map: milliseconds at S 2048, too much for every call)."""
        if self._library is None or self._library[0] is not self.coefficients:
            self._library = (self.coefficients, self._library_form())
        return self._library[1]

    def _library_form(self) -> tuple[bool, torch.Tensor | None] | None:
        if self.match.key_bias is not None or self.out_type.dtype != self.q_dtype:
            return None
        if any(g > 1 for g in self.groups[:-1]):  # torch groups the heads next to the query axis only
            return None
        folded = self.coefficients[1]
        if self.s_q * self.s_k > MAX_LIBRARY_MASK:
            plain = folded.kept == self.s_q * self.s_k and not folded.mixed.shape[0] and not folded.value.any()
            return (False, None) if plain else None
        b = folded.dense()
        kept = torch.isfinite(b)
        if kept.all() and not b.any():
            return False, None
        causal = torch.ones(self.s_q, self.s_k, dtype=torch.bool).tril()
        if torch.equal(kept, causal) and not b[kept].any():
            return True, None
        return False, (kept if not b[kept].any() else b.to(self.q_dtype))

    def _library_runner(self, env):
        causal, mask = self.library_form()
        m = self.match
        views = [self._library_view(self._operand(a, env, batch, seq, feature), length, width, grouped)
                 for a, batch, seq, feature, length, width, grouped in (
                     (m.q, self.batch_vars, self.l_var, self.d_var, self.s_q, self.d, False),
                     (m.k, self.batch_vars, self.m_var, self.d_var, self.s_k, self.d, True),
                     (m.v, self.out_batch_vars, self.r_var, self.e_var, self.s_k, self.dv, True))]
        gqa = {"enable_gqa": True} if self.groups[-1] > 1 else {}
        device = views[0].device
        results = {}  # the store's buffers, made at the first call whose output is not laid out as they are
        mask = self._library_mask(mask, str(device), lambda: mask.to(device)) if mask is not None else None
        scale = self.coefficients[0]
        if m.call_mask is not None:  # the call's mask, with the folded constant part (a causal mask) on it
            keep = _broadcast(self._library_view(self._operand(m.call_mask, env, self.batch_vars, self.l_var,
                                                               self.m_var), self.s_q, self.s_k, shared=False))
            # every layer of a model reads the same mask of the call: combined with the causal part once a call
            shared = (f"{SHARED_MASK}{m.call_mask.tensor}:{tuple(keep.shape)}:{keep.stride()}:"
                      f"{keep.storage_offset()}:{'causal' if causal else ''}:{self.q_dtype}")
            if mask is not None:  # a constant part of this match's own
                shared += f":{id(self)}"
            extra, mask, was_causal, causal = mask, None, causal, False

        if mask is not None and mask.dtype == torch.bool:  # a constant mask: torch's bias of it made once
            kwargs = dict(is_causal=causal, scale=scale, **gqa)
            signature = ([(tuple(v.shape), tuple(v.stride()), v.dtype, str(v.device)) for v in views],
                         sorted(kwargs.items()))
            boolean = mask
            mask = self._library_mask(boolean, str(signature), lambda: _library_bias(boolean, views, **kwargs))

        def run():
            attn_mask = mask
            if m.call_mask is not None:
                attn_mask = env.get(shared)
                if attn_mask is None:
                    attn_mask = env[shared] = self._combined_mask(keep, extra, was_causal)
                attn_mask = _as_library_bias(env, shared, attn_mask, views, is_causal=causal, scale=scale, **gqa)
            out = torch.nn.functional.scaled_dot_product_attention(*views, attn_mask=attn_mask, is_causal=causal,
                                                                   scale=scale, **gqa)
            if self.store is None:  # the library's own output is the node's value: no copy
                return {m.result: out}
            if out.stride() == self.store.strides:  # already laid out as the reader wants it (flash attention's
                # output is [batch, length, heads, width] in memory; cuDNN's follows Q's, see operand_layouts.py)
                return {m.result: out, self.store.buffer_name(m.result): out.as_strided(
                    self.store.shape, contiguous_strides(self.store.shape))}
            if not results:
                results.update(self._outputs(device))
            results[m.result].copy_(out)  # laid out through strides as the output's reader wants it
            return results
        return run

    def _library_mask(self, mask: torch.Tensor, key: str, make) -> torch.Tensor:
        """make(): the constant mask on a device, or torch's bias of it, kept until the mask is folded again
        (a copy to the device, or torch's conversion, once instead of at every call)."""
        if self._library_masks[0] is not self.coefficients:
            self._library_masks = (self.coefficients, {})
        made = self._library_masks[1]
        if (key, mask.dtype) not in made:
            made[key, mask.dtype] = make()
        return made[key, mask.dtype]

    def _combined_mask(self, keep: torch.Tensor, extra: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """The mask torch's attention is given: the call's `keep` with the match's constant part (causal, or
        `extra`: a boolean mask, or offsets added where `keep` holds). Boolean where it can be: torch turns a
        boolean mask into its own bias, and for cuDNN that bias is not -inf (a query whose every key is masked
        gets an answer other than a -inf bias's, and eager's answer is the boolean one's)."""
        if causal:
            return keep & torch.ones(self.s_q, self.s_k, dtype=torch.bool, device=keep.device).tril()
        if extra is None:
            return keep
        if extra.dtype == torch.bool:
            return keep & extra
        return torch.where(keep, extra.to(self.q_dtype), float("-inf"))

    def _runner(self, env, tiles: AttentionTiles):
        if tiles == LIBRARY:
            return self._library_runner(env)
        m = self.match
        q = self._operand(m.q, env, self.batch_vars, self.l_var, self.d_var)
        k = self._operand(m.k, env, self.batch_vars, self.m_var, self.d_var)
        v = self._operand(m.v, env, self.out_batch_vars, self.r_var, self.e_var)
        bias = None if m.key_bias is None else self._operand(m.key_bias, env, self.batch_vars, self.m_var, "")
        device = q.tensor.device
        plan = self._plan(tiles, device)
        results = self._outputs(device)
        out = self._grouped_view(results[m.result])
        parts = scratch(plan, math.prod(self.batch), self.dv, self.out_type.dtype, device)
        precision = self._precision(q.tensor.dtype)

        def run():
            launch(q, k, v, out, self.batch, plan, self.s_q, self.s_k, self.d, self.dv, precision,
                   bias, self.coefficients[2], parts)
            return results
        return run

    def _outputs(self, device) -> dict[str, torch.Tensor]:
        """The output node's tensor, and the buffer it is a view of when stored through strides (the copy's
        result, or `{output}_walked`, which the graph's reader reads instead, layout.read_walked)."""
        shape, dtype = self.out_type.shape, self.out_type.dtype
        if self.store is None:
            return {self.match.result: torch.empty(shape, dtype=dtype, device=device)}
        buffer = torch.empty(self.store.shape, dtype=dtype, device=device)
        return {self.match.result: buffer.as_strided(shape, self.store.strides),
                self.store.buffer_name(self.match.result): buffer}

    # -- tiles

    def _tiles(self, env) -> AttentionTiles:
        if self.match.call_mask is not None:  # our kernel folds constant masks only
            return LIBRARY
        pinned = self.options.get("attention_tiles")
        if pinned is not None:
            return pinned if isinstance(pinned, AttentionTiles) else AttentionTiles(*pinned)
        if interpreting():
            return INTERPRETER_TILES
        if not self.options.get("autotune", True):
            return DEFAULT_TILES
        key = f"{self.key}:{torch.cuda.get_device_name()}"
        cached = load_choice(key)
        if cached:
            return AttentionTiles(*cached)
        return self._tune(env, key)

    def _tune(self, env, key: str) -> AttentionTiles:
        """Time every candidate as a CUDA-graph replay, as a gpu program runs: timed as plain calls, a kernel
        of 20 µs is bound by its launches' host time, and a split plan (two launches) looked slower than it is
        (at S = 1024 the autotuner then kept 27.7 µs plans where split ones take 20)."""
        from .timing import graph_bench

        timings, best, best_s = {}, None, float("inf")
        for tiles in self._candidates(env):
            try:
                run = self._runner(env, tiles)
                run()
                torch.cuda.synchronize()
                seconds = graph_bench(run)[0]
            except Exception as err:  # a config the device cannot run (shared memory, registers)
                log.info("attention tiles %s failed: %s", tiles, err)
                continue
            timings[str(tiles)] = round(seconds * 1e6, 2)
            if seconds < best_s:
                best, best_s = tiles, seconds
        if best is None:
            raise RuntimeError(f"no tile config of {self.match} could run")
        log.info("%s: %s", self.match, ", ".join(f"{t} {us} us" for t, us in timings.items()))
        self.tuned_us = round(best_s * 1e6, 2)
        save_choice(key, [best.bm, best.bn, best.num_warps, best.num_stages, best.chunk], timings)
        return best

    def _candidates(self, env):
        """Tile shapes, each with the runs its plan may be split into (chunk_options)."""
        head_dim, key_bias = max(self.d, self.dv), self.match.key_bias is not None
        device = env[self.match.q.tensor].device
        for tiles in candidates(env[self.match.q.tensor].dtype, head_dim, key_bias):
            spills = head_dim > 64 and key_bias and astuple(tiles)[:4] in SPILL_SPLIT_WITH_KEY_BIAS
            for chunk in (0,) if spills else chunk_options(self._plan(tiles, device)):
                yield tiles.chunked(chunk)
        if self.library_form() is not None:
            yield LIBRARY

    def __call__(self, env) -> None:
        first = env[self.match.q.tensor]
        if first.device.type == "cpu" and not interpreting():
            for name in self.nodes:  # no GPU and no interpreter: the reference path
                env[name] = eval_node(self.graph.node_of[name], env, self.graph.type_of[name])
            return
        self._refold_if_changed()
        if self.chosen is None:
            self.chosen = self._tiles(env)
        env.update(self._runner(env, self.chosen)())

    def describe(self) -> str:
        if self.chosen == LIBRARY:
            causal, mask = self.library_form()
            how = "causal" if causal else "no mask" if mask is None else f"a {str(mask.dtype)[6:]} mask"
            return (f"{self.match}: batch {self.batch}, {self.s_q}x{self.s_k}, d {self.d}/{self.dv}; torch's "
                    f"scaled_dot_product_attention ({how}), timed faster than our tiles")
        plan = next((p for (tiles, _), p in self.plans.items() if tiles == self.chosen), None)
        tiles = str(plan) if plan is not None else str(self.chosen or "tiles chosen at the first call")
        into = f", {self.store}" if self.store else ""
        return f"{self.match}: batch {self.batch}, {self.s_q}x{self.s_k}, d {self.d}/{self.dv}{into}; {tiles}"

    def __str__(self) -> str:
        return f"attention({self.match.scores}..{self.match.output})"
