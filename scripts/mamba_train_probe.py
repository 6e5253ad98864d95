"""Where Mamba's training step under torch.compile(backend="stitchflow") spends its first call (the zoo sweep's
open check): each partition's capture, planning and compile logged with times, stacks dumped every --dump-s
seconds to --stacks, then the gradients compared with eager's. transformers' scan path is chosen by --scan:
"default" (the installed version's choice for the device), "loop" (use_associative_scan=False: the recurrent loop
over the sequence, unrolled by Dynamo).

    PYTHONPATH=. python scripts/mamba_train_probe.py --device cuda --scan default,loop --stacks /tmp/stacks.txt
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import sys
import time

import torch

sys.path.insert(0, "scripts")
import zoo_sweep as Z  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--scan", default="default,loop")
    ap.add_argument("--stacks", help="file for the periodic stack dumps")
    ap.add_argument("--dump-s", type=int, default=60)
    ap.add_argument("--target", help="the backend's target (default: gpu for CUDA tensors; gpu on the CPU runs "
                    "the generated kernels under TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if args.stacks:
        faulthandler.dump_traceback_later(args.dump_s, repeat=True, file=open(args.stacks, "w"))
    logging.basicConfig(format="%(relativeCreated)9.0f ms %(name)s: %(message)s")
    logging.getLogger("stitchflow").setLevel(logging.INFO)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.device}", flush=True)
    base = dict(Z.HF["MambaModel"])
    for scan in args.scan.split(","):
        Z.HF["MambaModel"] = dict(base, **({"use_associative_scan": False} if scan == "loop" else {}))
        torch.manual_seed(0)
        model = Z.hf_model("MambaModel").float().to(args.device)
        kw = Z.hf_inputs("MambaModel", args.device)
        torch._dynamo.reset()
        t0 = time.perf_counter()
        ok, err, gerr, first = Z.compare(f"MambaModel {scan}", model, kw, True, 1e-4,
                                           {"target": args.target} if args.target else {})
        print(f"scan {scan}: ok {ok}, output {err:.1e}, gradients {gerr:.1e}, first call {first:.1f} s, "
              f"all {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
