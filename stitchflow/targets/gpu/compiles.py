"""Generated kernels compiled on threads, ahead of their first launch.

Triton's compiler releases the GIL in its passes and runs ptxas as a process, so threads compile
configs in parallel. Two kinds of work share one pool of COMPILE_THREADS workers:

- an autotuning space the tuner is waiting for (`precompile`): urgent, compiled first;
- a program's kernels compiled ahead of its first call (`submit`, from prefetch.py): background
  work, in the order the program will need it. When the tuner comes to wait for a kernel that is
  still queued, its compiles are promoted to the front.

Both go through one AsyncCompileMode for the process, which knows every compile by Triton's cache
key: a compile asked for twice (prefetched, then wanted by the tuner) runs once.

A thread hands its compile to a worker process of its own (compile_worker.py), then compiles the
same specialization itself, a hit in Triton's cache: Triton's frontend holds the GIL while it walks
a kernel's AST, and sixteen threads doing so left the main thread (codegen, tuning, Dynamo) a
sixteenth of the interpreter. A worker holds Triton and the kernel modules it compiled (a few hundred MB
each); STITCHFLOW_COMPILE_PROCESSES=0 compiles on the threads alone, as does a process whose first worker
fails to start or to answer.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import functools
import heapq
import itertools
import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
from pathlib import Path

log = logging.getLogger("stitchflow.gpu")

# Threads compiling at once (STITCHFLOW_COMPILE_THREADS=1: one at a time in the caller, no deadline, no prefetch)
COMPILE_THREADS = int(os.environ.get("STITCHFLOW_COMPILE_THREADS", 0)) or min(16, os.cpu_count() or 1)
# Seconds the autotuner waits for a space's compiles; configs still compiling then are not timed. Register-held
# cooperative pieces of 16K-32K elements took 25-89 s each to compile on the H100's host (ResNet-18's stem batch
# norm, scripts/compile_time_probe.py) where the other configs took under 10.
COMPILE_DEADLINE_S = float(os.environ.get("STITCHFLOW_COMPILE_DEADLINE", 15))

_BACKGROUND: contextvars.ContextVar[bool] = contextvars.ContextVar("stitchflow_background_compiles", default=False)
PROCESSES = os.environ.get("STITCHFLOW_COMPILE_PROCESSES", "1") != "0"
_WORKER = Path(__file__).with_name("compile_worker.py")
_THREAD = threading.local()  # each compile thread's worker process


class Worker:
    """A compile_worker.py process: `run(job)` sends a job and returns its answer (None: compiled)."""

    def __init__(self):
        self.process = subprocess.Popen([sys.executable, str(_WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def run(self, job: tuple) -> str | None:
        data = pickle.dumps(job)
        self.process.stdin.write(struct.pack("<Q", len(data)) + data)
        self.process.stdin.flush()
        head = self.process.stdout.read(8)
        if len(head) < 8:
            raise EOFError(f"the compile worker exited (code {self.process.poll()})")
        return pickle.loads(self.process.stdout.read(struct.unpack("<Q", head)[0]))

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def worker_job(compile_fn) -> tuple | None:
    """The job for a worker process that does what `compile_fn` (the closure Triton's JIT hands an
    AsyncCompileMode: it compiles `src` for `target` with `options`) would, or None where it is not
    such a closure or not of a kernel loaded from a file (then the thread compiles it)."""
    names = getattr(getattr(compile_fn, "__code__", None), "co_freevars", ())
    if not {"src", "target", "options", "env_vars"} <= set(names):
        return None
    cells = dict(zip(names, (c.cell_contents for c in compile_fn.__closure__)))
    src, options = cells["src"], cells["options"]
    fn = getattr(getattr(src, "fn", None), "fn", None)
    module = sys.modules.get(getattr(fn, "__module__", ""), None)
    path = getattr(module, "__file__", None)
    if path is None or getattr(module, fn.__name__, None) is not src.fn:
        return None
    return (path, module.__name__, fn.__name__, dict(src.signature), dict(src.constants), dict(src.attrs),
            cells["target"], dict(vars(options)), cells["env_vars"])


_BROKEN: list[str] = []  # why worker processes were given up (the first failure to start or to answer)


def _compile(compile_fn):
    """`compile_fn()`, its compile done first by this thread's worker process where it can be."""
    job = worker_job(compile_fn) if PROCESSES and not _BROKEN else None
    if job is not None:
        try:
            worker = getattr(_THREAD, "worker", None) or Worker()
            _THREAD.worker = worker
            failure = worker.run(job)
            if failure is not None:  # compiled again below, which raises it here with its traceback
                log.debug("compile worker: %s", failure)
        except Exception as err:  # noqa: BLE001 (a worker that breaks costs its speed only)
            _THREAD.worker = None
            if not _BROKEN:  # e.g. no interpreter at sys.executable (an embedded Python): threads alone
                _BROKEN.append(f"{type(err).__name__}: {err}")
                log.info("stitchflow: compile worker processes given up (%s); compiling on threads", _BROKEN[0])
    return compile_fn()


class _Job:
    __slots__ = ("call", "future", "taken")

    def __init__(self, call, future):
        self.call, self.future, self.taken = call, future, False


class CompilePool(concurrent.futures.Executor):
    """At most `threads` daemon workers taking jobs urgent-first, then in submission order. A daemon
    worker does not hold the process at exit (a compile the tuner stopped waiting for still lands in
    Triton's cache), as a ThreadPoolExecutor's would."""

    def __init__(self, threads: int | None = None):
        self.threads = threads or COMPILE_THREADS
        self._reset()

    def _reset(self) -> None:
        self.pid = os.getpid()
        self.cond = threading.Condition()
        self.queue: list = []  # (0 urgent / 1 background, submission number, job)
        self.order = itertools.count()
        self.queued: dict = {}  # future -> its job, until a worker takes it
        self.workers = 0

    def submit(self, fn, /, *args, **kwargs):
        if os.getpid() != self.pid:  # a forked child: the parent's workers did not come along
            self._reset()
        future: concurrent.futures.Future = concurrent.futures.Future()
        # Triton's compiles come without arguments (a closure), and may go to a worker process
        job = _Job(functools.partial(fn, *args, **kwargs) if args or kwargs else functools.partial(_compile, fn), future)
        with self.cond:
            heapq.heappush(self.queue, (1 if _BACKGROUND.get() else 0, next(self.order), job))
            self.queued[future] = job
            if self.workers < self.threads:
                self.workers += 1
                threading.Thread(target=self._work, daemon=True, name="stitchflow-compile").start()
            self.cond.notify()
        return future

    def promote(self, futures) -> None:
        """Jobs of `futures` still queued go to the front (their old places are skipped)."""
        with self.cond:
            for future in futures:
                job = self.queued.get(future)
                if job is not None:
                    heapq.heappush(self.queue, (0, next(self.order), job))

    def _take(self) -> _Job:
        with self.cond:
            while True:
                while not self.queue:
                    self.cond.wait()
                _, _, job = heapq.heappop(self.queue)
                if not job.taken:
                    job.taken = True
                    del self.queued[job.future]
                    return job

    def _work(self) -> None:
        while True:
            job = self._take()
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                job.future.set_result(job.call())
            except BaseException as err:  # noqa: BLE001 (handed to whoever waits)
                job.future.set_exception(err)


@functools.cache
def compile_pool() -> CompilePool:
    """One for the process, so that compiles left running past a deadline count against the next space's."""
    return CompilePool()


@functools.cache
def _async_mode():
    """The process's AsyncCompileMode (None for a Triton without one): each compile is known by its cache key,
    so one asked for again while in flight is the same future."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode(compile_pool(), ignore_errors=True)


def _start(launches: list, env: dict) -> list[tuple]:
    """(launch, its pending FutureKernels) for every launch of `launches` that compiles with Triton (others,
    e.g. cluster kernels, are skipped); a phase already compiled is not pending."""
    from triton.runtime._async_compile import active_mode

    token = active_mode.set(_async_mode())
    started = []
    try:
        for launch in launches:
            if not hasattr(launch, "compile"):
                continue
            try:
                pending = [k for k in launch.compile(env) if hasattr(k, "future")]
            except Exception as err:  # noqa: BLE001 (binding failed before compiling: timing says why)
                log.debug("%s: not precompiled: %s", getattr(launch, "title", launch), err)
                continue
            started.append((launch, pending))
    finally:
        active_mode.reset(token)
    return started


def submit(launches: list, env: dict) -> int:
    """Queue the compiles of `launches` as background work (a program's kernels ahead of its first call);
    returns how many compiles were queued or found in flight."""
    if COMPILE_THREADS < 2 or _async_mode() is None:
        return 0
    token = _BACKGROUND.set(True)
    try:
        return sum(len(pending) for _, pending in _start(launches, env))
    finally:
        _BACKGROUND.reset(token)


def precompile(launches: list, env: dict, deadline: float | None = None) -> set:
    """Compile the generated kernels of `launches` at once on threads, before any is timed, so that a space
    compiles in about the time of its slowest config instead of their sum; compiles already queued (by
    `submit`) go to the front. Waits `deadline` seconds at most (longer only if no launch is ready by then;
    None: until all are) and returns the launches not compiled by then. A config that fails here fails again
    when timed, which records why."""
    if COMPILE_THREADS < 2 or _async_mode() is None:
        return set()
    started = _start(launches, env)
    futures = [k.future for _, ks in started for k in ks]
    compile_pool().promote(futures)
    concurrent.futures.wait(futures, timeout=deadline)
    if started and not any(all(k.future.done() for k in ks) for _, ks in started):
        # nothing in time: the heuristic's first choice, however long it takes
        concurrent.futures.wait([k.future for k in started[0][1]])
    late = set()
    for launch, kernels in started:
        if all(k.future.done() for k in kernels):
            for k in kernels:
                k.result(ignore_errors=True)  # into the JIT's cache, where the launch finds it
        else:
            late.add(launch)
    return late
