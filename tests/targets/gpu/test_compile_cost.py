"""What a cold start costs on the gpu target: kernels alike but for their names are one source (one
Triton compile) and share one autotuning run; an autotuning space compiles on threads, with a
deadline for stragglers. CPU parts run under TRITON_INTERPRET=1; the tuner's own paths need a GPU."""

import os
import tempfile
import threading
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("STITCHFLOW_CACHE", tempfile.mkdtemp(prefix="stitchflow-test-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import stitchflow  # noqa: E402
from stitchflow.targets.gpu import compiles, runtime  # noqa: E402
from stitchflow.targets.gpu.codegen import kernel_name  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                               reason="the autotuner times configs on a CUDA GPU (TRITON_INTERPRET=0)")


def _two_alike_blocks(x, w):
    """Two norm + GELU groups with a GEMM between them (a torch step, so they are two kernels)."""
    y = F.gelu(F.layer_norm(x, x.shape[-1:]))
    return F.gelu(F.layer_norm(y @ w, x.shape[-1:]))


def _body(source: str) -> str:
    """The source without the module's docstring (which names the group)."""
    return source.split('"""', 2)[2]


def _kernels(prog):
    return [k for run in prog._compiled for k in run.kernels]


def _device():
    return "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def test_kernels_alike_but_for_names_are_one_source_and_one_tuning_key():
    x, w = torch.randn(6, 40, device=_device()), torch.randn(40, 40, device=_device())
    prog = stitchflow.compile(_two_alike_blocks, [x, w], target="gpu", fusion="full")
    torch.testing.assert_close(prog(x, w), _two_alike_blocks(x, w), rtol=1e-4, atol=1e-4)
    first, second = _kernels(prog)
    assert first.title != second.title
    (a,), (b,) = first._built.values(), second._built.values()
    assert a.spec.name == b.spec.name == kernel_name(first.title)
    assert _body(a.spec.source) == _body(b.spec.source)  # one Triton compile serves both
    assert "@triton.jit" in _body(a.spec.source)
    (sig_a,), (sig_b,) = first._built, second._built
    assert first._cache_key(sig_a, "dev") == second._cache_key(sig_b, "dev")


def test_tuning_keys_tell_apart_strides_shapes_and_devices():
    x, w = torch.randn(6, 40, device=_device()), torch.randn(40, 40, device=_device())
    prog = stitchflow.compile(_two_alike_blocks, [x, w], target="gpu", fusion="full")
    prog(x, w)
    kernel = _kernels(prog)[0]
    (sig,) = kernel._built
    transposed = tuple((t, stride[::-1], *rest) for t, stride, *rest in sig)
    keys = {kernel._cache_key(sig, "dev"), kernel._cache_key(transposed, "dev"), kernel._cache_key(sig, "other")}
    assert len(keys) == 3
    args = [torch.randn(6, 48, device=_device()), torch.randn(48, 48, device=_device())]
    wide = stitchflow.compile(_two_alike_blocks, args, target="gpu", fusion="full")
    wide(*args)
    (wide_sig,) = _kernels(wide)[0]._built
    assert _kernels(wide)[0]._cache_key(wide_sig, "dev") != kernel._cache_key(sig, "dev")


def test_kernel_names_keep_the_ops_and_drop_regions_and_numbers():
    assert kernel_name("r6:mul_6..softmax_2") == "sf_mul__softmax"
    assert kernel_name("r12:var_mean_1_mean..relu_14") == "sf_var_mean_mean__relu"
    assert kernel_name("forward.r0:le_16..mul_319") == "sf_le__mul"


def test_traffic_counts_inputs_once_and_outputs():
    x, w = torch.randn(6, 40), torch.randn(40, 40)
    prog = stitchflow.compile(_two_alike_blocks, [x, w], target="gpu", fusion="full")
    kernel = _kernels(prog)[0]  # x -> layer norm -> gelu, fp32 [6, 40] in and out
    assert kernel.inputs == ["x"] and [o for p in kernel.plans for o in p.outputs] == ["gelu"]
    assert kernel._traffic({"x": x}) == 2 * 6 * 40 * 4


def test_a_tuning_that_timed_part_of_its_space_is_redone_by_the_next_process(monkeypatch, tmp_path):
    monkeypatch.setenv("STITCHFLOW_CACHE", str(tmp_path))
    runtime.save_choice("k", 2, {"a": 1.0}, partial=True)
    assert runtime.load_choice("k") is None and runtime.load_timing("k", "a") == 1.0
    runtime.save_choice("k", 3, {"a": 1.0, "b": 0.5})
    assert runtime.load_choice("k") == 3


def test_an_autotune_option_it_does_not_know_is_named():
    from stitchflow.ir.errors import TargetError

    x, w = torch.randn(6, 40, device=_device()), torch.randn(40, 40, device=_device())
    prog = stitchflow.compile(_two_alike_blocks, [x, w], target="gpu", fusion="full", options={"autotune": "max"})
    with pytest.raises(TargetError, match="autotune.*True, False or 'all'.*'max'"):
        prog(x, w)


def test_background_compiles_return_results_and_errors_and_bound_concurrency():
    pool = compiles.CompilePool(threads=2)
    running, peak, lock = [0], [0], threading.Lock()

    def job(k):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        if k == 3:
            raise ValueError("config 3 does not compile")
        return k * k

    futures = [pool.submit(job, k) for k in range(6)]
    assert [f.exception() is None and f.result() for f in futures if f.exception() is None] == [0, 1, 4, 16, 25]
    assert "config 3" in str(futures[3].exception())
    assert peak[0] <= 2
    assert all(t.daemon for t in threading.enumerate() if t.name == "stitchflow-compile")


@needs_gpu
@pytest.mark.parametrize("deadline", [0.0, 60.0])
def test_autotuning_compiles_a_space_on_threads_and_times_what_is_ready(monkeypatch, tmp_path, deadline):
    """With no time to wait, the tuner still times the heuristic's first config (and whatever else is ready);
    with time, every config; both give eager's answer."""
    monkeypatch.setenv("STITCHFLOW_CACHE", str(tmp_path))  # no cached choices
    monkeypatch.setattr(runtime, "COMPILE_DEADLINE_S", deadline)
    monkeypatch.setattr(runtime, "TUNE_MIN_BYTES", 0)
    x, w = torch.randn(512, 1000, device="cuda"), torch.randn(1000, 1000, device="cuda")
    prog = stitchflow.compile(_two_alike_blocks, [x, w], target="gpu", fusion="full",
                              options={"cuda_graphs": False})
    torch.testing.assert_close(prog(x, w), _two_alike_blocks(x, w), rtol=2e-4, atol=2e-4)
    first = _kernels(prog)[0]
    assert first.tuned_us is not None and first.chosen is not None
    (sig,) = first._built
    timed = runtime.json.loads(runtime._config_store().read_text())["_timings_us"][
        first._cache_key(sig, torch.cuda.get_device_name())]
    assert timed and (deadline == 0.0 or len(timed) > 1)


def test_the_pool_runs_urgent_work_first_then_promoted_then_in_submission_order():
    pool = compiles.CompilePool(threads=1)
    gate, order = threading.Event(), []
    blocker = pool.submit(gate.wait)  # holds the one worker while the queue fills

    def background(k):
        token = compiles._BACKGROUND.set(True)
        try:
            return pool.submit(order.append, f"background {k}")
        finally:
            compiles._BACKGROUND.reset(token)

    queued = [background(k) for k in range(4)]
    urgent = pool.submit(order.append, "urgent")
    pool.promote([queued[2]])
    gate.set()
    for f in [blocker, urgent, *queued]:
        f.result(timeout=10)
    assert order == ["urgent", "background 2", "background 0", "background 1", "background 3"]


_KERNELS = '''
import triton
import triton.language as tl


@triton.jit
def doubled(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(x + offs, mask=offs < n) * 2.0, mask=offs < n)


@triton.jit
def broken(x, BLOCK: tl.constexpr):
    tl.store(x + tl.arange(0, BLOCK), no_such_name)
'''


def _triton_closure(fn, block):
    """What Triton's JIT hands an AsyncCompileMode: a closure over src, target, options and env_vars (no GPU
    needed: the target is named)."""
    import triton
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", 90, 32)
    options, env_vars = make_backend(target).parse_options({}), get_cache_invalidating_env_vars()
    src = ASTSource(fn, {"x": "*fp32", "y": "*fp32", "n": "i32", "BLOCK": "constexpr"} if fn.__name__ == "doubled"
                    else {"x": "*fp32", "BLOCK": "constexpr"}, {"BLOCK": block})

    def async_compile():
        return triton.compile(src, target=target, options=options.__dict__, _env_vars=env_vars)

    return async_compile


def test_a_worker_process_compiles_into_tritons_cache_and_a_failure_is_raised_by_the_thread(monkeypatch, tmp_path):
    import importlib.util
    import sys

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # real JIT functions, compiled for a named target
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    path = tmp_path / "kernels_for_worker.py"
    path.write_text(_KERNELS)
    spec = importlib.util.spec_from_file_location("kernels_for_worker", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "kernels_for_worker", module)
    spec.loader.exec_module(module)

    job = compiles.worker_job(_triton_closure(module.doubled, 128))
    assert job[:3] == (str(path), "kernels_for_worker", "doubled")
    assert compiles.worker_job(lambda: None) is None  # not Triton's closure: compiled on the thread
    worker = compiles.Worker()
    try:
        assert worker.run(job) is None
        assert any((tmp_path / "triton").rglob("doubled.cubin"))  # the binary the thread's compile will find
        assert "no_such_name" in worker.run(compiles.worker_job(_triton_closure(module.broken, 16)))
    finally:
        worker.close()
    assert compiles._compile(_triton_closure(module.doubled, 256)).name == "doubled"
    with pytest.raises(Exception) as raised:  # Triton's CompilationError, raised by the thread's own compile
        compiles._compile(_triton_closure(module.broken, 32))
    assert type(raised.value).__name__ == "CompilationError"


def test_workers_that_cannot_start_are_given_up_once_and_the_thread_compiles(monkeypatch, tmp_path):
    monkeypatch.setattr(compiles, "_BROKEN", [])
    monkeypatch.setattr(compiles, "_WORKER", tmp_path / "missing_worker.py")  # the interpreter exits at once
    monkeypatch.setattr(compiles._THREAD, "worker", None, raising=False)
    calls = []

    def fake_triton_closure(src="s", target="t", options=None, env_vars=None):
        def async_compile():
            calls.append((src, target, options, env_vars))
            return "compiled"
        return async_compile

    monkeypatch.setattr(compiles, "worker_job", lambda fn: ("job",))
    assert compiles._compile(fake_triton_closure()) == "compiled"
    assert compiles._BROKEN  # EOFError (it exited) or a broken pipe, whichever comes first
    assert compiles._compile(fake_triton_closure()) == "compiled" and len(calls) == 2


def test_a_forked_child_gets_workers_of_its_own():
    """After a fork only the forking thread exists in the child: a pool that counted the parent's workers
    would queue jobs nobody takes."""
    pool = compiles.CompilePool(threads=2)
    assert [pool.submit(lambda k: k + 1, k).result(timeout=10) for k in range(4)] == [1, 2, 3, 4]
    child = os.fork()
    if child == 0:  # the child: its answer is its exit code (nothing of pytest's runs here)
        try:
            ok = pool.submit(lambda k: k + 1, 41).result(timeout=10) == 42
        except BaseException:  # noqa: BLE001
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(child, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
