"""A program's call replayed as one CUDA graph.

The Python dispatch of every region, kernel and library call leaves the hot path (torch.compile's
reduce-overhead mode does the same). The first calls run normally (autotuning happens there); the
second is timed, the graph captured on the third is timed too and kept only if it is faster both
to the end of its device work and on the host. A capture that fails (a host sync, a sparse op) is
logged and the program keeps running normally.

A graph reads and writes fixed addresses. By default a replay copies each input into the graph's
own buffer and clones each output out of it, which costs a copy and an allocation per tensor: a
training step's graphs take and give a hundred activations. Two kinds of tensors skip that
(CUDA Graph Trees' idea, in small):

- *handed-over outputs* (`options["free_outputs"]`: a forward's activations saved for its
  backward, gradients passed on inside the backward) leave as the graph's own buffers, not
  clones. Before the next replay overwrites them, every one of them must be free again (its
  storage referenced by nothing outside the graph); where one is still held, that call runs
  without the graph and allocates afresh, so a held tensor is never overwritten;
- *borrowed inputs*: an input that is, at capture, another graph's handed-over output, or a
  parameter or buffer (a tensor Dynamo marks as living at a fixed address) or a view of one (a
  transposed weight a forward saved for its backward), is read where it lies instead of copied.
  A replay needs each borrowed input at that same address (with the same strides); otherwise
  the call runs without the graph.

What is replayed is any callable from inputs to named outputs: a Program's call, or a whole
AOTAutograd graph with its eager ops and the programs of its partitions (`AotGraphReplay`: one
graph launch for a training step's backward, cuDNN's convolution backwards included). Inside a
capture, a program runs plainly: the outer graph records its kernels.
"""

from __future__ import annotations

import contextvars
import logging
from collections import ChainMap
import time
import weakref
from dataclasses import dataclass

import torch

log = logging.getLogger("stitchflow")

# set while a whole AOTAutograd graph runs under its own replayer: the programs inside defer to it
_UNDER_OUTER_REPLAY: contextvars.ContextVar[bool] = contextvars.ContextVar("stitchflow_outer_replay", default=False)

# data pointer of a handed-over output -> the replayer that owns it (borrowers look them up at capture)
_HANDED_OVER: "weakref.WeakValueDictionary[int, GraphReplay]" = weakref.WeakValueDictionary()
# storage address of a parameter or buffer some replayer read in place -> that tensor: a view of it
# (AOTAutograd's backward takes the forward's transposed weights as saved tensors) lies there too
_FIXED_STORAGES: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def storage_uses(t: torch.Tensor) -> int:
    """How many tensors (and storage objects) hold `t`'s storage."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


@dataclass
class _Slot:
    """One captured graph and the buffers it reads and writes."""

    graph: "torch.cuda.CUDAGraph"
    static_inputs: list  # per tensor input: the graph's buffer, or None where borrowed
    borrowed: dict  # tensor position -> (data pointer, strides) read in place
    static_env: dict  # what the capture made, by name (borrowed inputs left out)
    handed_over: dict  # output name -> its storage's uses when nothing outside holds it
    aliases: set  # outputs that are views of borrowed inputs
    written_back: dict  # output name -> tensor position of the borrowed input the graph copies it into

    def ready(self, tensors) -> bool:
        """Every borrowed input where the graph reads it, and every handed-over output free again."""
        for k, (pointer, stride) in self.borrowed.items():
            if tensors[k].data_ptr() != pointer or tensors[k].stride() != stride:
                return False
        return all(storage_uses(self.static_env[name]) <= uses for name, uses in self.handed_over.items())

    def replay(self, tensors, outputs) -> dict:
        targets, sources = [], []
        for static, x in zip(self.static_inputs, tensors):
            if static is None:  # borrowed: read where it lies
                continue
            if static.layout == torch.sparse_csr:  # the members are the static tensor's own storage
                targets += [static.crow_indices(), static.col_indices(), static.values()]
                sources += [x.crow_indices(), x.col_indices(), x.values()]
            else:
                targets.append(static)
                sources.append(x)
        if targets:
            torch._foreach_copy_(targets, sources)
        self.graph.replay()
        out = {}
        for name in dict.fromkeys(outputs):
            if name in self.written_back:  # the input itself: the caller's copy into it is a no-op
                out[name] = tensors[self.written_back[name]]
                continue
            made = self.static_env[name]
            # a handed-over output (or a view of a borrowed input) leaves as a new tensor on the same
            # storage: a handed-over one's uses then count who holds it
            if not isinstance(made, torch.Tensor):
                out[name] = made
            elif name in self.handed_over or name in self.aliases:
                out[name] = made.detach()
            else:
                out[name] = made.clone()
        return out


class GraphReplay:
    WARMUP_CALLS = 2
    # A second graph on its own buffers is captured when the first one's handed-over outputs are still
    # held at the next call: a training loop's `loss` of the last step lives until the next forward
    # returns, its graph (and what the backward kept) with it. Two sets then take turns.
    MAX_SLOTS = 2

    def __init__(self, run, outputs, free=(), inputs=(), keep_always: bool = False, on_replay=None,
                 defers_to_outer: bool = True, written_back=None, tail=None):
        """`run(inputs)` makes the outputs' environment (name -> value) by a plain call; `outputs` names
        what a call returns, `free` the outputs that may be handed over, `inputs` the environment's
        names of the inputs (not kept after capture); `on_replay()` is told of every replay.
        `keep_always` keeps a captured graph without the comparison (options={"cuda_graphs": "always"}:
        a host-bound loop whose timing at the third call is not representative, and tests that must
        exercise the replay whatever the timing). `defers_to_outer`: a program's replayer runs plainly
        inside a whole graph's replayer (which records its kernels): graphs of its own would only hold
        a third set of buffers. `written_back`: output name -> position among the call's arguments of
        the input the caller copies that output into (AOTAutograd's input mutations: batch norm's
        running statistics); where that input is borrowed, the graph copies it there itself and
        returns the input, so the caller's copy does nothing (two copies and their launches saved).
        `tail`: (names, fn) where `fn(env)` makes the outputs `names` from what `run` made, run after `run` on
        every call and outside the graph after a replay: library calls that allocate large outputs (a language
        model's logits) give them fresh, where a replay would clone them out of its buffers (GPT-2's 206 MB of
        logits at 4 x 512 tokens: 1970 → 1729 µs a call on an H200). `fn` reads what the program makes and its
        parameters, not the call's inputs (a replay's environment holds the inputs' copies only in its slot)."""
        self.run, self.outputs, self.free, self.input_names = run, tuple(outputs), set(free), set(inputs)
        self.tail_names, self.tail = (tuple(tail[0]), tail[1]) if tail else ((), None)
        self.graphed_outputs = [name for name in self.outputs if name not in self.tail_names]
        self.written_back = dict(written_back or {})
        self.on_replay = on_replay
        self.keep_always = keep_always
        self.calls = 0
        self.failed: str | None = None  # why calls run without a graph (capture failed, not worth it)
        self.plain_ms = self.replay_ms = (float("inf"), float("inf"))  # (to the device's end, on the host)
        self.slots: list[_Slot] = []
        self.plain_calls = 0  # calls that ran without a graph: held outputs or moved inputs in every slot
        self.defers_to_outer = defers_to_outer

    @property
    def graph(self):
        return self.slots[0].graph if self.slots else None

    @property
    def handed_over(self) -> set[str]:
        return {name for slot in self.slots for name in slot.handed_over}

    @property
    def borrowed(self) -> set[int]:
        return {k for slot in self.slots for k in slot.borrowed}

    def applies(self, inputs) -> bool:
        """CUDA inputs, dense or CSR (a GNN's adjacency); a CSR input must keep the non-zero count of
        the captured one (its structure is copied in, as a dense input's values are)."""
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        if self.failed is not None or not tensors or not all(
                t.is_cuda and t.layout in (torch.strided, torch.sparse_csr) for t in tensors):
            return False
        return not self.slots or all(
            s is None or s.layout != torch.sparse_csr or s.values().numel() == t.values().numel()
            for s, t in zip(self.slots[0].static_inputs, tensors))

    def __call__(self, inputs) -> dict:
        """The environment of the outputs (names -> values) for `inputs`."""
        if (self.defers_to_outer and _UNDER_OUTER_REPLAY.get()) or torch.cuda.is_current_stream_capturing():
            return self._plain(inputs)  # an outer graph records (or will record) our kernels
        self.calls += 1
        if not self.slots and self.calls < self.WARMUP_CALLS:
            return self._plain(inputs)
        if not self.slots and self.calls == self.WARMUP_CALLS:
            self.plain_ms, env = best_of(lambda: self._plain(inputs))
            return env
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        if not self.slots:
            slot = self._capture(inputs)
            if slot is None:
                return self._plain(inputs)
            restore = _restorer(slot, tensors)  # each timed replay updates the written-back inputs once
            self.replay_ms, outputs = best_of(lambda: self._replay(slot, tensors), before=restore)
            if not self.keep_always and not self._worth_it():
                self._release()
                log.info("stitchflow: no CUDA graph, %s", self.failed)
            return outputs
        for slot in self.slots:
            if slot.ready(tensors):
                return self._replay(slot, tensors)
        if len(self.slots) < self.MAX_SLOTS:
            slot = self._capture(inputs)
            if slot is not None:
                return self._replay(slot, tensors)
        self.plain_calls += 1
        return self._plain(inputs)

    def _plain(self, inputs) -> dict:
        env = self.run(inputs)
        if self.tail is not None:
            self.tail(env)
        return env

    def _worth_it(self) -> bool:
        """A replay must be faster both to the end of its device work and on the host: a call that
        returns sooner but queues copies lengthens a step whose device is the bottleneck, and one
        that ends sooner in isolation but spends longer on the host (a copy and an allocation per
        input and output) lengthens a step whose host is."""
        (plain, plain_host), (replay, replay_host) = self.plain_ms, self.replay_ms
        if replay < plain and replay_host < plain_host:
            return True
        self.failed = (f"not worth a graph: a replay took {replay:.3f} ms ({replay_host:.3f} ms on the host), a plain "
                       f"call {plain:.3f} ms ({plain_host:.3f} ms on the host)")
        return False

    def _replay(self, slot: _Slot, tensors) -> dict:
        out = slot.replay(tensors, self.graphed_outputs)
        if self.tail is not None:  # on the graph's buffers, which the next replay overwrites only after it
            env = ChainMap({}, slot.static_env)  # the tail's outputs land in the new map, not the slot's
            self.tail(env)
            out.update((name, env[name]) for name in self.tail_names)
        if self.on_replay is not None:
            self.on_replay()
        return out

    def _capture(self, inputs) -> _Slot | None:
        """A new slot captured on `inputs` (appended), or None where the capture failed (then no graph
        is tried again)."""
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        borrowed = {k: (x.data_ptr(), x.stride()) for k, x in enumerate(tensors) if x.layout == torch.strided and (
            _HANDED_OVER.get(x.data_ptr()) not in (None, self) or _fixed_address(x))}
        borrowed_storages = {tensors[k].untyped_storage().data_ptr() for k in borrowed}
        for k in borrowed:
            if _marked_fixed(tensors[k]):
                _FIXED_STORAGES[tensors[k].untyped_storage().data_ptr()] = tensors[k]
        static_inputs = [None if k in borrowed else x.clone() for k, x in enumerate(tensors)]
        static = iter([x if s is None else s for x, s in zip(tensors, static_inputs)])
        bound = [next(static) if isinstance(x, torch.Tensor) else x for x in inputs]
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # one run on a side stream, as torch's docs ask
                self.run(bound)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                env = self.run(bound)
                written_back = self._write_back(env, bound, inputs, borrowed)
        except Exception as err:  # capture refuses host syncs and some library calls
            self.failed = f"{type(err).__name__}: {err}"
            log.info("stitchflow: CUDA graph capture failed, running without it: %s", self.failed)
            torch.cuda.synchronize()
            self._release()
            return None
        del bound, static, tensors
        # nothing of ours may hold a borrowed input: its owner counts the holders before it replays
        static_env = {name: t for name, t in env.items() if name not in self.input_names or name in self.outputs}
        del env
        made = {name: t for name, t in static_env.items() if name in self.outputs and isinstance(t, torch.Tensor)}
        # views of a borrowed input (a transposed weight saved for the backward) are the caller's memory
        aliases = {name for name, t in made.items() if t.untyped_storage().data_ptr() in borrowed_storages}
        handed_over = {name: storage_uses(t) for name, t in made.items()
                       if name in self.free - self.input_names - aliases}
        del made
        slot = _Slot(graph, static_inputs, borrowed, static_env, handed_over, aliases, written_back)
        for name in handed_over:
            _HANDED_OVER[static_env[name].data_ptr()] = self
        self.slots.append(slot)
        return slot

    def _write_back(self, env, bound, inputs, borrowed) -> dict:
        """Inside the capture: each written-back output copied into its input where that input is
        borrowed (so at the same address at every replay) and of the output's shape and dtype;
        {output name: tensor position} of those."""
        positions = {k: n for n, k in enumerate(k for k, x in enumerate(inputs) if isinstance(x, torch.Tensor))}
        pairs = {}
        for name, k in self.written_back.items():
            t, value = positions.get(k), env.get(name)
            if t is None or t not in borrowed or not isinstance(value, torch.Tensor):
                continue
            target = bound[k]
            if value.shape == target.shape and value.dtype == target.dtype and value.device == target.device:
                pairs[name] = (t, target, value)
        by_dtype: dict = {}  # one fused copy per dtype: mixed lists take a copy (a graph node) per tensor
        for _, target, value in pairs.values():
            targets, values = by_dtype.setdefault(target.dtype, ([], []))
            targets.append(target)
            values.append(value)
        for targets, values in by_dtype.values():
            torch._foreach_copy_(targets, values)
        return {name: t for name, (t, _, _) in pairs.items()}

    def _release(self) -> None:
        for slot in self.slots:
            for name in slot.handed_over:
                if _HANDED_OVER.get(slot.static_env[name].data_ptr()) is self:
                    del _HANDED_OVER[slot.static_env[name].data_ptr()]
        self.slots = []


def _restorer(slot: _Slot, tensors):
    """A callable that puts back what the inputs a slot writes back into held now, or None."""
    if not slot.written_back:
        return None
    kept = [(tensors[t], tensors[t].clone()) for t in slot.written_back.values()]

    def restore() -> None:
        for target, value in kept:
            target.copy_(value)
    return restore


def _marked_fixed(t: torch.Tensor) -> bool:
    """A parameter or buffer: Dynamo marks those as living at a fixed address (an optimizer updates
    them in place)."""
    return isinstance(t, torch.nn.Parameter) or getattr(t, "_dynamo_static_input_type", None) is not None


def _fixed_address(t: torch.Tensor) -> bool:
    """A parameter or buffer, or a view of one that a replayer has read in place."""
    if _marked_fixed(t):
        return True
    owner = _FIXED_STORAGES.get(t.untyped_storage().data_ptr())
    # the parameter may have moved since (`p.data = ...`), and something else come to lie there
    return owner is not None and owner.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


class AotGraphReplay:
    """One of AOTAutograd's graphs (its partitions' programs and eager ops together, as compiled by
    backend._partition_and_wrap) replayed as one CUDA graph: the host launches a training step's
    backward, twenty cuDNN convolution backwards among it, as one graph. `free_from`: the first
    output position that may be handed over (a forward's saved activations; 0 for a backward,
    whose gradients autograd takes as they are), None for none."""

    def __init__(self, fn, n_outputs: int, free_from: int | None, keep_always: bool = False,
                 written_back: dict[int, int] | None = None):
        """`written_back`: {output position: input position} of the inputs AOTAutograd copies outputs
        into."""
        self.fn = fn
        AOT_REPLAYS.add(self)
        names = [f"out{k}" for k in range(n_outputs)]
        free = names[free_from:] if free_from is not None else ()
        back = {names[out]: k for out, k in (written_back or {}).items() if out < n_outputs}
        self.replay = GraphReplay(self._run, names, free, keep_always=keep_always, defers_to_outer=False,
                                  written_back=back)

    def _run(self, inputs) -> dict:
        out = self.fn(*inputs)
        return {f"out{k}": v for k, v in enumerate(out if isinstance(out, (tuple, list)) else (out,))}

    def __call__(self, *args):
        if not self.replay.applies(args):  # not CUDA, or declined: the programs inside may replay on their own
            return self.fn(*args)
        token = _UNDER_OUTER_REPLAY.set(True)
        try:
            env = self.replay(args)
        finally:
            _UNDER_OUTER_REPLAY.reset(token)
        return [env[name] for name in self.replay.outputs]


AOT_REPLAYS: "weakref.WeakSet[AotGraphReplay]" = weakref.WeakSet()  # for tests and reports


def best_of(call, repeats: int = 3, before=None):
    """((the shortest wall time in ms of `call` to the end of its device work, the shortest until it
    returned), its last result). The previous result is dropped before each call, so that a replay's
    handed-over outputs are free again for the next; `before()` runs before each call, untimed."""
    best, host, result = float("inf"), float("inf"), None
    for _ in range(repeats):
        result = None
        if before is not None:
            before()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = call()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        best, host = min(best, (time.perf_counter() - t0) * 1e3), min(host, (t1 - t0) * 1e3)
    return (best, host), result
