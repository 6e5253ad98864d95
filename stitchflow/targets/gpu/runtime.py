"""Compile, cache, autotune and launch generated kernels.

Generated source is written to `$STITCHFLOW_CACHE/gpu/kernels/<hash>.py` (default
~/.cache/stitchflow) and imported from there: Triton's JIT reads a kernel's source from its
file, and the file doubles as the on-disk cache (Triton caches the binaries). The config an
autotuning run chose is kept in `configs.json` beside it, keyed by the group's signature and
the device, so later processes skip the timing.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import sys
from pathlib import Path

import torch

from ...ir.errors import TargetError
from ...ir.graph import Graph
from ...ir.interpret import eval_node
from ...ir.paths import cache_root
from . import cluster_planes
from .check import check_outputs
from .analysis import PartPlan
from .codegen import KernelSpec, build_kernel, kernel_inputs
from .scatter_stores import part_nodes, stored
from .compiles import COMPILE_DEADLINE_S, precompile, submit
from .mapping import Config, candidates, max_coop_split, resident_per_sm, unsplit_config

log = logging.getLogger("stitchflow.gpu")

LAUNCHES: collections.Counter = collections.Counter()  # kernel title -> launches (tests read it)
_MODULES: dict = {}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cache_dir() -> Path:
    path = cache_root() / "gpu"
    (path / "kernels").mkdir(parents=True, exist_ok=True)
    return path


def load_source(source: str):
    """Import generated source (once per process); the file stays as the on-disk cache."""
    key = hashlib.sha256(source.encode()).hexdigest()[:24]
    if key in _MODULES:
        return _MODULES[key]
    path = cache_dir() / "kernels" / f"k_{key}.py"
    if not path.exists() or path.read_text() != source:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        tmp.replace(path)
    name = f"stitchflow_gen_{key}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    _MODULES[key] = module
    return module


def _config_store() -> Path:
    return cache_dir() / "configs.json"


def load_choice(key: str) -> list | None:
    """The config chosen for `key`, unless its tuning timed only part of the space (configs past the compile
    deadline): then the next process tunes again, its compiles found in Triton's cache."""
    try:
        table = json.loads(_config_store().read_text())
    except (OSError, ValueError):
        return None
    return None if key in table.get("_partial", {}) else table.get(key)


def load_timing(key: str, label: str) -> float | None:
    """The autotuner's median for config `label` of `key`, when a run recorded it."""
    try:
        return json.loads(_config_store().read_text()).get("_timings_us", {}).get(key, {}).get(label)
    except (OSError, ValueError, AttributeError):
        return None


def save_choice(key: str, choice: list, timings: dict, partial: bool = False) -> None:
    path = _config_store()
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    table[key] = choice
    table.setdefault("_timings_us", {})[key] = timings
    if partial:
        table.setdefault("_partial", {})[key] = True
    else:
        table.get("_partial", {}).pop(key, None)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
    tmp.replace(path)


# Part of every autotuning cache key: bump it when generated code changes what a config means, so that
# configs chosen for older code are timed again (4: cooperative splits, variances at their mean's barrier;
# 5: contiguous axis runs addressed as one coordinate; 6: TMA-fed column pieces, counters never reset;
# 8: cluster planes join the space; 9: timings leave out calls that waited on the host, so choices made
# during a loaded cold start are made again).
CODEGEN_VERSION = 9


# A kernel that moves fewer bytes than this runs its first (heuristic) config untimed: its configs differ by a
# microsecond at most, and compiling each costs about a second (a ResNet's backward has dozens of such kernels:
# batch norm's running statistics, per-channel sums of small stages).
TUNE_MIN_BYTES = 256 * 1024
_IDENT = re.compile(r"[A-Za-z_]\w*")


# options that pin a generated kernel's config (mapping.candidates' override)
PINS = ("block_p", "block_l", "split", "num_warps", "persistent", "prefetch", "coop", "tma", "cp_async")


class Launch:
    """A built kernel: allocates outputs and scratch, launches every phase. After the first
    launch through Triton's JIT (which compiles), later launches call the compiled kernel
    directly, skipping the JIT's argument binding: this is most of the host overhead that
    small patterns pay per call."""

    def __init__(self, graph: Graph, spec: KernelSpec, title: str):
        self.graph, self.spec, self.title = graph, spec, title
        self.module = load_source(spec.source)
        # (shape, dtype, the value a scatter's output starts at or None) per output
        fills = dict(spec.fills)
        self.out_specs = [(graph.type_of[t].shape, graph.type_of[t].dtype, fills.get(t)) for t in spec.outputs]
        self.grid = (spec.grid,)
        self.fast: list | None = None  # one compiled-kernel runner per phase
        # Gluon kernels too: the compiled kernel's launcher turns each TensorDescriptor into a tensor map
        # (STITCHFLOW_GLUON_JIT=1 keeps them on the JIT's path)
        self.fast_ok = not interpreting() and not (spec.gluon and os.environ.get("STITCHFLOW_GLUON_JIT") == "1")
        self.resident_checked = False
        # positions of inputs on the host where the others are on the device (the group's signature fixes each
        # input's device type): None until a call on real tensors found them
        self.host_inputs: tuple | None = None
        self.counters: dict = {}  # (device, stream) -> the scratch and row counters (see _buffers)
        # the interpreter runs programs one at a time and takes no launch attributes
        self.launch_options = {"launch_cooperative_grid": True} if spec.cooperative and not interpreting() else {}

    def _arguments(self, env) -> tuple[list, list, torch.device]:
        """(kernel arguments, the outputs among them (freshly allocated), the device)."""
        spec = self.spec
        ins = [env[t] for t in spec.inputs]
        if self.host_inputs is None or self.host_inputs:  # found once: each call would cost host time
            device = _kernel_device(ins)
            host = tuple(k for k, x in enumerate(ins) if x.device != device)
            if device.type != "meta":  # (prefetch's meta tensors say nothing of where the call's will be)
                self.host_inputs = host
            for k in host:  # eager mixes a host constant into CUDA ops; a kernel cannot
                ins[k] = ins[k].to(device)
        else:
            device = ins[0].device if ins else torch.device("cuda")
        outs = [torch.empty(shape, dtype=dt, device=device) if fill is None else
                torch.full(shape, fill, dtype=dt, device=device) for shape, dt, fill in self.out_specs]
        args = ins + outs + (self._buffers(device) if spec.buffers else [])
        args += [tma_descriptor(env[t], box, view) for t, box, view in spec.tma]
        return args, outs, device

    def compile(self, env) -> list:
        """Compile every phase for `env`'s tensors without launching; returns the compiled kernels (under
        Triton's AsyncCompileMode, futures of them: see `precompile`)."""
        args, _, _ = self._arguments(env)
        return [self.module.kernel.warmup(*args, grid=self.grid, PHASE=phase, num_warps=self.spec.num_warps,
                                          **self.launch_options) for phase in range(self.spec.phases)]

    def __call__(self, env) -> None:
        spec = self.spec
        args, outs, device = self._arguments(env)
        if self.fast is not None:
            # Triton's launcher itself, given the stream: its runner looks the stream up through
            # torch.cuda and asks for launch hooks on every call, half of a launch's host time
            stream = _raw_stream(device)
            for phase, k in enumerate(self.fast):
                k.run(spec.grid, 1, 1, stream, k.function, k.packed_metadata, None, None, None, *args, phase)
        else:
            if not self.resident_checked and spec.coop_group and not interpreting() and (
                    spec.gluon or spec.cooperative or spec.coop_group > max_coop_split(_sms(device))):
                self._check_residency(args, device)
            self.resident_checked = True  # once (a kernel without the fast path comes here on every call)
            compiled = [self.module.kernel[self.grid](*args, PHASE=phase, num_warps=spec.num_warps,
                                                      **self.launch_options)
                        for phase in range(spec.phases)]
            if self.fast_ok and all(c is not None for c in compiled) and _no_launch_hooks():
                for c in compiled:
                    c._init_handles()
                self.fast = compiled
        LAUNCHES[self.title] += spec.phases
        for name, value in zip(spec.outputs, outs):
            env[name] = value

    def _buffers(self, device) -> list:
        """The kernel's scratch and a cooperative split's row counters, made once per stream: the
        counters are zeroed then and launches only add to them (codegen_split.row_barrier); the
        scratch is written before it is read within a launch, and launches on one stream run in
        turn, so they share it. One set per stream, so that calls on two streams, which may
        overlap, never share them; allocating them per call cost host time on every launch."""
        if device.type == "meta":  # prefetch's call on meta tensors: nothing to keep
            return [torch.empty(n, dtype=dt, device=device) for _, n, dt in self.spec.buffers]
        key = (device, _raw_stream(device))
        found = self.counters.get(key)
        if found is None:
            found = self.counters[key] = [
                torch.zeros(n, dtype=dt, device=device) if dt == torch.int64 else torch.empty(n, dtype=dt, device=device)
                for _, n, dt in self.spec.buffers]
        return found

    def _check_residency(self, args, device) -> None:
        """A cooperative split over more programs than one per SM on half the SMs waits forever
        unless the GPU holds the whole group at once: compile first, and refuse (ValueError, which
        the autotuner skips) unless the occupancy leaves room for twice the group. A cooperative
        launch (persistent grids) needs room for the whole grid, or the driver refuses it: say
        why first."""
        kernel = self.module.kernel.warmup(*args, grid=self.grid, PHASE=0, num_warps=self.spec.num_warps,
                                           **self.launch_options)
        kernel = kernel.result() if hasattr(kernel, "result") else kernel  # compiled under AsyncCompileMode
        kernel._init_handles()
        per_sm = resident_per_sm(self.spec.num_warps, kernel.n_regs, kernel.metadata.shared)
        if self.spec.cooperative:
            if self.spec.grid > per_sm * _sms(device):
                raise ValueError(f"a cooperative grid of {self.spec.grid} programs must be resident at once, but "
                                 f"{kernel.n_regs} registers and {kernel.metadata.shared} bytes of shared memory "
                                 f"per program leave {per_sm} per SM on {_sms(device)} SMs")
        elif self.spec.coop_group * 2 > per_sm * _sms(device):
            raise ValueError(f"a cooperative split of {self.spec.coop_group} programs needs them all resident, but "
                             f"{kernel.n_regs} registers per thread leave {per_sm} per SM")


def _kernel_input(inputs: list) -> torch.Tensor:
    """The input whose device a kernel runs on: the first, or the first off the host where eager mixed host
    tensors in (MPNet's relative-position buckets, made on the host and moved by the model itself only later)."""
    return next((x for x in inputs if x.device.type != "cpu"), inputs[0])


def _kernel_device(inputs: list) -> torch.device:
    return _kernel_input(inputs).device if inputs else torch.device("cuda")


def _raw_stream(device) -> int:
    """The current stream's handle (torch.cuda.current_stream(device).cuda_stream costs 9 µs a call,
    this 0.2: measured by scripts/launch_path_probe.py)."""
    if device.type != "cuda":
        return 0
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else torch.cuda.current_device())


def _no_launch_hooks() -> bool:
    """Whether Triton has launch hooks to call (a profiler such as Proton sets them): the direct
    launch skips them, so it is taken only where there are none."""
    from triton import knobs

    return knobs.runtime.launch_enter_hook is None and knobs.runtime.launch_exit_hook is None


def tma_descriptor(t: torch.Tensor, box: tuple[int, ...], view: tuple[int, ...] | None = None):
    """A Hopper TMA descriptor of `t` (seen as `view` when given: batch norm's planes as
    [N*C, rows, cols]) in `box` tiles, with the shared-memory layout the kernel allocates its
    buffers in (Gluon; imported here only for TMA-fed kernels)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if view is not None:
        t = t.view(view)
    return TensorDescriptor.from_tensor(t, list(box), _tma_layout(tuple(box), t.dtype))


@functools.lru_cache(maxsize=None)
def _tma_layout(box: tuple[int, ...], dtype: torch.dtype):
    """2-D boxes take the swizzled default; 3-D ones none (their buffers are read back as one flat
    tile). Cached: building the layout was a third of a descriptor's host time, paid every call."""
    from triton.experimental.gluon import language as gl

    if len(box) == 2:
        gl_dtype = {torch.float32: gl.float32, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
        return gl.NVMMASharedLayout.get_default_for(list(box), gl_dtype)
    bits = torch.empty((), dtype=dtype).element_size() * 8
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=bits, rank=len(box))


def _sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


class GroupKernel:
    """Nodes of one group run as one generated kernel; built lazily at the first call, since
    the generated addresses use the strides of the tensors actually passed."""

    def __init__(self, graph: Graph, plans: list[PartPlan], options: dict, title: str, group_names: set):
        self.graph, self.plans, self.options, self.title = graph, plans, options, title
        # parts only inlined elsewhere have no program of their own: one working part is not packed (it may split)
        self.packed = sum(1 for p in plans if p.outputs) > 1
        self.group_names = group_names
        self.inputs = kernel_inputs(graph, [n for p in plans for n in part_nodes(p)], group_names)
        self._built: dict = {}
        self._prefetched: dict = {}  # signature -> (configs, launches) whose compiles prefetch queued
        self.tuned_us: float | None = None
        self.chosen: list[Config] | None = None
        self.cluster_plans: list = []  # cluster_planes sizes this part can take (set by _build)
        self.check = options.get("check_kernels", os.environ.get("STITCHFLOW_CHECK_KERNELS") == "1")

    def _space(self, plan: PartPlan, sms: int, no_streaming: str | None) -> list[Config]:
        """`no_streaming`: why streamed pieces (tma, cp_async) cannot run here, or None."""
        override = {k: self.options[k] for k in PINS if k in self.options}
        space = candidates(plan, sms, override or None)
        if plan.scatters and not no_streaming:  # Gluon's streamed pieces have no atomics here
            no_streaming = "store scatters, whose atomics the streamed (Gluon) kernels do not emit"
        if no_streaming:
            if override and (override.get("tma") or override.get("cp_async")):
                raise ValueError(f"streamed cooperative pieces (tma, cp_async) {no_streaming}")
            space = [c for c in space if not (c.tma or c.cp_async)]
        if interpreting() or self.packed:  # the interpreter runs programs one at a time: nobody to wait for
            if any(c.coop for c in space) and override and override.get("coop"):
                raise ValueError("a cooperative split (coop) needs a GPU: its programs wait for each other, and "
                                 "the interpreter runs them one at a time" if interpreting() else
                                 "a cooperative split cannot share a launch with packed parts")
            space = [c for c in space if not c.coop]
        if self.packed:  # packed parts share one launch: no phase barriers
            space = [c for c in space if c.split == 1 or not plan.reductions] or [unsplit_config(plan, sms)]
        return space

    def _evaluated(self, env) -> set[str]:
        """The nodes a call evaluates without kernels: the parts' own, and the producers of the group
        that their kernels would inline (a part kept only to be inlined stores nothing)."""
        needed, todo = set(), [n.name for p in self.plans for n in part_nodes(p)]
        while todo:
            name = todo.pop()
            if name not in needed:
                needed.add(name)
                todo += [t for t in self.graph.node_of[name].inputs if t in self.group_names and t not in env]
        return needed

    def _signature(self, env, device_type: str | None = None) -> tuple:
        """Per input: strides, device type, and whether its base is 16-byte aligned (TMA needs it;
        a misaligned view of the same strides gets a kernel of its own). `device_type` stands for the
        tensors' own where they are meta tensors (prefetch)."""
        return tuple((t, env[t].stride(), device_type or env[t].device.type, env[t].data_ptr() % 16 == 0)
                     for t in self.inputs)

    def __call__(self, env) -> None:
        if not any(p.outputs for p in self.plans):  # nothing stored (argmax's unused peak): nothing to launch
            return
        first = env[self.inputs[0]] if self.inputs else None
        if first is not None:  # where eager mixes host tensors in: a device tensor
            first = _kernel_input([env[t] for t in self.inputs])
        # no GPU and no interpreter, or nothing read (an arange, an identity: torch makes them where the
        # program's tensors are, which a kernel with no inputs would not know)
        if first is None or (first.device.type == "cpu" and not interpreting()):
            # nothing read: the program's device (the backend's, for a partition that takes no tensor and makes
            # CUDA ones: BART's attention mask, all aranges), else the CPU
            device = self.options.get("device") if first is None else None
            # in the graph's order: a plan may read a value (a constant folded into the kernels) that a
            # later plan makes
            needed = self._evaluated(env)
            for n in self.graph.nodes:
                if n.name in needed:
                    value = eval_node(n, env, self.graph.type_of[n.name])
                    env[n.name] = value.to(device) if device is not None and isinstance(value, torch.Tensor) else value
            return
        sig = self._signature(env)
        launch = self._built.get(sig)
        if launch is None:
            launch = self._built[sig] = self._build(env, sig)
        launch(env)
        if self.check:
            check_outputs(self, launch, env)

    def _choice(self, env, sig, device) -> tuple[list, dict, bool, int | None, str | None]:
        """(the configs, the strides, whether on a GPU, the config to run untimed or None to tune, the
        tuning key or None). `device`: the tensors' device (`env` may hold meta tensors: see prefetch)."""
        strides = {t: s for t, s, _, _ in sig}
        on_gpu = any(kind == "cuda" for _, _, kind, _ in sig) and not interpreting()
        sms = _sms(device) if on_gpu else 132
        no_streaming = None  # streamed pieces are Gluon kernels for sm_90 and later, fed by 16-byte-aligned TMA
        if not on_gpu or torch.cuda.get_device_capability(device)[0] < 9:
            no_streaming = "need a Hopper GPU (sm_90 or later)"
        elif not all(aligned for _, _, _, aligned in sig):
            no_streaming = "need inputs whose base is 16-byte aligned (TMA)"
        elif any(kind != "cuda" for _, _, kind, _ in sig):
            no_streaming = "need every input on the device (TMA)"
        # a part with no outputs launches nothing: one config stands for it
        spaces = [self._space(p, sms, no_streaming)[:None if p.outputs else 1] for p in self.plans]
        variants = max(len(s) for s in spaces)
        configs = [[s[min(v, len(s) - 1)] for s in spaces] for v in range(variants)]
        configs = self._with_clusters(configs, strides, device if on_gpu else None)
        autotune = self.options.get("autotune", True)
        if autotune not in (True, False, "all"):
            raise TargetError(f"options['autotune'] must be True, False or 'all' (every config of every kernel "
                              f"compiled and timed), not {autotune!r}")
        if not on_gpu or not autotune or len(configs) == 1:
            return configs, strides, on_gpu, 0, None
        if self._traffic(env) < TUNE_MIN_BYTES and autotune != "all":
            log.debug("%s: too few bytes move to time %d configs: the first one runs", self.title, len(configs))
            return configs, strides, on_gpu, 0, None
        key = self._cache_key(sig, torch.cuda.get_device_name(device))
        cached = load_choice(key)
        return configs, strides, on_gpu, cached if cached is not None and cached < len(configs) else None, key

    def _build(self, env, sig) -> Launch:
        configs, strides, on_gpu, pick, key = self._choice(env, sig, _kernel_device([env[t] for t in self.inputs]))
        made = self._prefetched.pop(sig, ((), ()))  # configs and launches compiling since prefetch
        made = {tuple(cfgs): launch for cfgs, launch in zip(*made) if launch is not None}
        if pick is not None:
            if key is not None:
                self.tuned_us = load_timing(key, ",".join(map(str, configs[pick])))
            self.chosen = configs[pick]
            launch = made.get(tuple(configs[pick]))
            if launch is None:
                return self._launch(configs[pick], strides, on_gpu)
            precompile([launch], env)  # wait for its compile in flight rather than compile it again
            return launch
        autotune = self.options.get("autotune", True)
        deadline = None if autotune == "all" else self.options.get("compile_deadline", COMPILE_DEADLINE_S)
        return self._tune(configs, strides, env, key, deadline, [made.get(tuple(cfgs)) for cfgs in configs])

    def prefetch(self, env, device) -> int:
        """Queue the compiles that this kernel's first call will want (every config it will time, or the one it
        will run), for `env`'s tensors, which may be meta tensors standing for the call's (prefetch.py), and
        put its outputs in `env` as the launch would make them. Returns the compiles queued."""
        if not any(p.outputs for p in self.plans) or not self.inputs:
            return 0
        sig = self._signature(env, device.type)
        if sig in self._built or sig in self._prefetched:
            return 0
        configs, strides, on_gpu, pick, _ = self._choice(env, sig, device)
        wanted = configs if pick is None else [configs[pick]]
        # cluster kernels compile with nvcc when made: left to the tuner
        launches = [None if cfgs[0].cluster else self._launch_or_none(cfgs, strides, on_gpu) for cfgs in wanted]
        self._prefetched[sig] = (wanted, launches)
        for p in self.plans:
            for name in stored(p):
                ty = self.graph.type_of[name]
                env[name] = torch.empty(ty.shape, dtype=ty.dtype, device=env[self.inputs[0]].device)
        return submit([launch for launch in launches if launch is not None], env) if on_gpu else 0

    def _with_clusters(self, configs: list, strides: dict, device) -> list:
        """Plane statistics on thread-block clusters (cluster_planes) join the space last, so that cached
        choices of the other configs keep their index; options["cluster"] True keeps only them, False (or a
        pinned Triton config) none."""
        wanted = self.options.get("cluster")
        pinned = any(k in self.options for k in PINS)
        if wanted is False or (pinned and not wanted) or len(self.plans) > 1 or not self.plans[0].reductions \
                or self.plans[0].scatters:
            return configs
        why = cluster_planes.unavailable(device) if device is not None else "cluster planes need a CUDA device"
        plans, refusals = ([], [why]) if why else cluster_planes.cluster_plans(self.graph, self.plans[0], strides)
        self.cluster_plans = plans[:2]  # two sizes at most, timed in one compiled module
        found = [[Config(1, cp.planes * cp.plane, cp.cluster, cluster_planes.THREADS // 32, coop=True, cluster=True)]
                 for cp in self.cluster_plans]
        if wanted:
            if not found:
                raise ValueError("no cluster planes for this part: " + "; ".join(refusals))
            return found
        for reason in refusals:
            log.debug("%s: %s", self.title, reason)
        return configs + found

    def _launch_or_none(self, cfgs: list[Config], strides: dict, on_gpu: bool):
        """The launch, or None where generating it fails (the tuner tries again and records why)."""
        try:
            return self._launch(cfgs, strides, on_gpu)
        except Exception as err:  # noqa: BLE001
            log.debug("%s: %s not prefetched: %s", self.title, ",".join(map(str, cfgs)), err)
            return None

    def _launch(self, cfgs: list[Config], strides: dict, on_gpu: bool):
        if cfgs[0].cluster:
            variant = [cp.cluster for cp in self.cluster_plans].index(cfgs[0].split)
            return cluster_planes.ClusterLaunch(self.graph, self.plans[0], self.cluster_plans, variant, self.title,
                                                str(cache_dir() / "cuda"), LAUNCHES)
        spec = build_kernel(self.graph, list(zip(self.plans, cfgs)), strides, not on_gpu, self.title, self.group_names)
        return Launch(self.graph, spec, self.title)

    def _traffic(self, env) -> int:
        """Bytes the kernel reads (its inputs, once) and writes (its outputs)."""
        read = sum(env[t].numel() * env[t].element_size() for t in self.inputs)
        types = [self.graph.type_of[o] for p in self.plans for o in stored(p)]
        return read + sum(math.prod(t.shape) * t.dtype.itemsize for t in types)

    def _cache_key(self, sig, device_name: str) -> str:
        """The autotuning cache's key: the device, the inputs' strides and the nodes with every tensor named by
        its position, so that kernels alike but for names (a ResNet's repeated blocks, the layers of a
        transformer) share one timing run."""
        names = {t: f"%in{k}" for k, t in enumerate(self.inputs)}
        for n in (n for p in self.plans for n in part_nodes(p)):
            names.setdefault(n.name, f"%{len(names)}")
        # a node's notes (its tag's id, the module it came from) do not change the kernel
        text = "\n".join(_IDENT.sub(lambda m: names.get(m.group(0), m.group(0)), str(n).split("  # ")[0])
                         + str(self.graph.type_of[n.name]) for p in self.plans for n in part_nodes(p))
        shape = tuple(rest for _, *rest in sig)
        return hashlib.sha256(f"{CODEGEN_VERSION}|{device_name}|{shape}|{text}".encode()).hexdigest()[:32]

    def _tune(self, configs, strides, env, key, deadline: float | None, made: list | None = None) -> Launch:
        """`made`: launches prefetch made for `configs` (None where it left one to be made here)."""
        from .timing import timed_median

        best, best_t, timings, failures = None, float("inf"), {}, []
        launches = []
        for v, cfgs in enumerate(configs):
            try:
                launches.append(made[v] if made is not None and made[v] is not None else
                                self._launch(cfgs, strides, True))
            except Exception as err:  # refused while generating (GluonRefusal): recorded with the timed ones' failures
                launches.append(err)
        late = precompile(launches, env, deadline)
        for v, (cfgs, launch) in enumerate(zip(configs, launches)):
            try:
                if isinstance(launch, Exception):
                    raise launch
                if launch in late:
                    raise TimeoutError(f"still compiling after {deadline:g} s (not timed)")
                scratch = dict(env)
                launch(scratch)
                torch.cuda.synchronize()
                t = timed_median(lambda: launch(scratch), budget_s=0.02) * 1e3  # ms
            except Exception as err:  # a config the device cannot run (resources): skip it
                log.info("config %s failed: %s", [str(c) for c in cfgs], err)
                failures.append(f"{','.join(map(str, cfgs))}: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
                continue
            timings[",".join(map(str, cfgs))] = round(t * 1000, 2)
            if t < best_t:
                best, best_t = v, t
        if best is None:
            raise TargetError(f"no config of {self.title} could run on this device ({len(failures)} tried); "
                              f"the first failed with {failures[0] if failures else 'nothing to try'}")
        self.tuned_us = round(best_t * 1000, 2)
        save_choice(key, best, timings, partial=bool(late))
        self.chosen = configs[best]
        return launches[best]
