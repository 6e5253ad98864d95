"""A process that compiles Triton kernels into Triton's on-disk cache, for compiles.py's pool.

Run by path (`python compile_worker.py`), so that it imports Triton and the kernel's own module,
not stitchflow or torch. It reads jobs from stdin and answers each on stdout, both as
length-prefixed pickles: a job is (the kernel module's file, the module's name, the kernel's name,
Triton's signature, constexprs and attrs of the specialization, the target, the options, the
cache-invalidating environment); the answer is None, or why the compile failed. The parent then
compiles the same specialization itself and finds the binary in the cache: the compile's Python
(Triton's frontend walks the kernel's AST holding the GIL) runs here, off the parent's GIL.
"""

import importlib.util
import pickle
import struct
import sys


def _module(path: str, name: str, loaded: dict):
    if path not in loaded:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        loaded[path] = module
    return loaded[path]


def compile_job(job: tuple, loaded: dict) -> None:
    import triton

    path, module_name, kernel_name, signature, constexprs, attrs, target, options, env_vars = job
    fn = getattr(_module(path, module_name, loaded), kernel_name)
    if fn.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        from triton.compiler import ASTSource as Source
    triton.compile(Source(fn, signature, constexprs, attrs), target=target, options=options, _env_vars=env_vars)


def serve(jobs, answers) -> None:
    loaded: dict = {}
    while True:
        head = jobs.read(8)
        if len(head) < 8:  # the parent closed the pipe: it has exited or let us go
            return
        job = pickle.loads(jobs.read(struct.unpack("<Q", head)[0]))
        try:
            compile_job(job, loaded)
            answer = None
        except BaseException as err:  # noqa: BLE001 (the parent compiles again and raises it itself)
            answer = f"{type(err).__name__}: {err}"
        data = pickle.dumps(answer)
        answers.write(struct.pack("<Q", len(data)) + data)
        answers.flush()


if __name__ == "__main__":
    protocol = sys.stdout.buffer
    sys.stdout = sys.stderr  # whatever a compile prints must not mix into the answers
    serve(sys.stdin.buffer, protocol)
