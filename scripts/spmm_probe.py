"""Device probe: every CSR × dense layout of `targets/gpu/spmm.py` against torch's product (cuSPARSE) on
the bench graphs' adjacencies, at the feature widths a GNN's products gather, each as CUDA-graph replays
(`timing.graph_bench`, as the step's autotuner). Not a test.

    PYTHONPATH=. python3 scripts/spmm_probe.py [dataset ...]
"""
import sys

import torch

from stitchflow.apps import APPS
from stitchflow.targets.gpu.spmm import CONFIGS
from stitchflow.targets.gpu.timing import graph_bench


def main():
    for dataset in sys.argv[1:] or ["cora", "arxiv-synthetic"]:
        _, (a, _) = APPS["gcn"].build(size="default", dataset=dataset)
        a = a.cuda()
        for features in (7, 16, 64, 128):
            d = torch.randn(a.shape[1], features, device="cuda")
            ref = a.to_dense().double() @ d.double() if a.shape[0] < 20000 else (a @ d).double()
            times = {"torch": graph_bench(lambda: a @ d)[0]}
            for config in CONFIGS:
                out = config(a, d, torch.float32)
                err = ((out.double() - ref).norm() / ref.norm()).item()
                assert err < 1e-5, (config, err)
                times[str(config)] = graph_bench(lambda config=config: config(a, d, torch.float32))[0]
            best = min(times, key=times.get)
            print(f"{dataset} nnz {a.values().numel()} F={features}: torch {times['torch'] * 1e6:.1f} us, best "
                  f"{best} {times[best] * 1e6:.1f} us ({times['torch'] / times[best]:.2f}x)")
            print("   ", ", ".join(f"{k} {v * 1e6:.1f}" for k, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
