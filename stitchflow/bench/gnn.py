"""`stitchflow bench gnn`: FuseFlow's GNNs on the GPU, stitchflow's gpu target against eager PyTorch (its CSR
products through torch.sparse / cuSPARSE), torch.compile and torch_geometric, same process, same inputs and weights;
and the torch_geometric model itself under torch.compile, with inductor and with the stitchflow backend.

    python -m stitchflow.bench.gnn [--cases gcn:cora,gcn:arxiv-synthetic] [--out DIR] [--markdown BENCHMARKS.md]

The models are the app zoo's (`APPS["gcn"]`, `APPS["graphsage"]`: the 0/1 adjacency as a CSR tensor, 50%-sparse
weights stored dense). torch_geometric runs the same layers with the same weights as message passing over the edge
list (`GCNConv(normalize=False, add_self_loops=False)`, `SAGEConv(aggr="sum")`), as most of its users do. Every
competitor is checked against eager, then timed as the stitching bench times (medians over calls with L2 evicted
clean before each, three rounds in turn). The floor is the adjacency read once per layer plus the features and the
output once, at the copy bandwidth measured in the same run. On the gpu target the sparse products still run
through torch; the dense GEMMs with their epilogues and the softmax are generated kernels.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from torch import nn

from ..apps.gnn import GCNLayer, SAGELayer, activate
from .report import device_info, failure_lines, publish, run_cases, us_cell
from .stitching import ROUNDS, _time_in_rounds, copy_bandwidth
from .stitching_patterns import relative_error

SECTION = "## GNNs on the GPU (sparse)"
CASES = ("gcn:cora", "gcn:arxiv-synthetic", "graphsage:cora", "graphsage:arxiv-synthetic")
RUNNERS = ("eager", "torch.compile", "torch_geometric", "stitchflow", "pyg+torch.compile", "pyg+stitchflow")


class PygGNN(nn.Module):
    """An app-zoo GCN or GraphSAGE as torch_geometric layers holding the same weights. Takes (edge_index, x) with
    edge_index = [source, target] = [column, row] of the adjacency, so a node sums over its row's columns."""

    def __init__(self, model: nn.Module):
        from torch_geometric.nn import GCNConv, SAGEConv

        super().__init__()
        self.convs, self.activations = nn.ModuleList(), []
        for layer in model.layers():
            if isinstance(layer, GCNLayer):
                fan_in, fan_out = layer.weight.shape
                conv = GCNConv(fan_in, fan_out, normalize=False, add_self_loops=False, bias=True)
                conv.lin.weight.data = layer.weight.detach().t().contiguous()
                conv.bias.data = layer.bias.detach().clone()
            elif isinstance(layer, SAGELayer):
                fan_in, fan_out = layer.weight_self.shape
                conv = SAGEConv(fan_in, fan_out, aggr="sum", root_weight=True, bias=True)
                conv.lin_l.weight.data = layer.weight_neigh.detach().t().contiguous()
                conv.lin_l.bias.data = layer.bias.detach().clone()
                conv.lin_r.weight.data = layer.weight_self.detach().t().contiguous()
            else:
                raise TypeError(f"no torch_geometric counterpart for {type(layer).__name__}")
            self.convs.append(conv.to(layer.bias.device, layer.bias.dtype))
            self.activations.append(layer.activation)

    def forward(self, edge_index: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        for conv, activation in zip(self.convs, self.activations):
            x = activate(conv(x, edge_index), activation)
        return x


def edge_list(adjacency: torch.Tensor) -> torch.Tensor:
    """[source, target] of every non-zero of a 0/1 CSR adjacency (row i sums over its columns j: j -> i)."""
    values = adjacency.values()
    if not bool((values == 1).all()):
        raise ValueError("torch_geometric's layers here take a 0/1 adjacency (no edge weights)")
    rows = torch.repeat_interleave(torch.arange(adjacency.shape[0], device=values.device),
                                   adjacency.crow_indices().diff())
    return torch.stack([adjacency.col_indices(), rows])


def floor_bytes(adjacency: torch.Tensor, x: torch.Tensor, out: torch.Tensor, layers: int) -> int:
    csr = sum(t.numel() * t.element_size() for t in (adjacency.crow_indices(), adjacency.col_indices(),
                                                       adjacency.values()))
    return layers * csr + x.numel() * x.element_size() + out.numel() * out.element_size()


def bench_case(case: str, copy_bw: float) -> dict:
    import stitchflow
    from stitchflow.apps import APPS

    app, dataset = case.split(":")
    torch._dynamo.reset()
    model, (a, x) = APPS[app].build(size="default", dataset=dataset)
    model, a, x = model.cuda(), a.cuda(), x.cuda()
    edges = edge_list(a)
    row = {"case": case, "nodes": a.shape[0], "nnz": a.values().numel(), "features": x.shape[1]}
    with torch.no_grad():
        ref = model(a, x)
        makers = {
            "eager": lambda: (lambda: model(a, x)),
            "torch.compile": lambda: (lambda f: (lambda: f(a, x)))(torch.compile(model, dynamic=False)),
            "torch_geometric": lambda: (lambda f: (lambda: f(edges, x)))(PygGNN(model)),
            "stitchflow": lambda: (lambda p: (lambda: p(a, x)))(
                stitchflow.compile(model, (a, x), target="gpu", fusion="auto",
                                   options={"autotune": "all"})),  # every kernel timed, Cora's small ones too
            # the same torch_geometric model under torch.compile, inductor and our backend (its scatters)
            "pyg+torch.compile": lambda: (lambda f: (lambda: f(edges, x)))(
                torch.compile(PygGNN(model), dynamic=False)),
            "pyg+stitchflow": lambda: (lambda f: (lambda: f(edges, x)))(
                torch.compile(PygGNN(model), backend="stitchflow", dynamic=False)),
        }
        ready = {}
        for name, make in makers.items():
            try:  # one failing competitor must not hide the others
                fn = make()
                row[f"{name} err"] = relative_error(fn(), ref)
                if row[f"{name} err"] <= 1e-4:
                    ready[name] = fn
                else:
                    row[f"{name} error"] = f"relative error {row[f'{name} err']:.2g} against eager"
            except Exception as exc:
                row[f"{name} error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rounds = _time_in_rounds({name: (lambda fn=fn: fn()) for name, fn in ready.items()}, [()])
    for name, times in rounds.items():
        row[f"{name} us"] = statistics.median(times)
        row[f"{name} rounds us"] = [round(t, 1) for t in times]
    row["floor us"] = floor_bytes(a, x, ref, len(model.layers())) / copy_bw * 1e6
    return row


def _ratio(row: dict, slow: str, fast: str) -> str:
    return f"{row[slow + ' us'] / row[fast + ' us']:.2f}x" if row.get(slow + " us") and row.get(fast + " us") else "-"


def markdown(rows: list[dict], info: dict) -> str:
    lines = [SECTION, "",
             f"Command: `{info['command']}`  ",
             f"Device: {info['device']}; {info['date']}; torch {info['torch']}, triton {info['triton']}; "
             f"copy {info['copy_bw_tbs']:.2f} TB/s  ",
             "fp32; the app zoo's GCN (softmax output) and GraphSAGE (sum aggregation), 2 layers, hidden 16. eager: "
             "the CSR products through torch.sparse; torch_geometric: the same layers and weights as message "
             f"passing over the edge list; stitchflow: `stitchflow.compile(target=\"gpu\", fusion=\"auto\")`; "
             "pyg+: the torch_geometric model under torch.compile (inductor) and torch.compile(backend=\"stitchflow\"). Median "
             f"of {ROUNDS} rounds (the competitors in turn) of medians over calls, L2 evicted clean before each; "
             "every competitor checked against eager first (relative error ≤ 1e-4). Floor: the adjacency read "
             "once per layer, the features and the output once, at the copy bandwidth.", "",
             "| case | nodes | non-zeros | features | eager µs | torch.compile µs | torch_geometric µs | stitchflow µs "
             "| stitchflow vs eager | vs torch_geometric | floor µs | stitchflow / floor | pyg+torch.compile µs "
             "| pyg+stitchflow µs | pyg+stitchflow vs torch_geometric |",
             "|" + "---|" * 15]
    for r in rows:
        if "nodes" not in r:
            lines.append(f"| {r['case']} | failed: {r.get('error', '')[:100]} |")
            continue
        sf = r.get("stitchflow us")
        over_floor = f"{sf / r['floor us']:.1f}" if sf else "-"
        lines.append(f"| {r['case']} | {r['nodes']} | {r['nnz']} | {r['features']} | {us_cell(r, 'eager')} | "
                     f"{us_cell(r, 'torch.compile')} | {us_cell(r, 'torch_geometric')} | {us_cell(r, 'stitchflow')} | "
                     f"{_ratio(r, 'eager', 'stitchflow')} | {_ratio(r, 'torch_geometric', 'stitchflow')} | "
                     f"{r['floor us']:.1f} | {over_floor} | {us_cell(r, 'pyg+torch.compile')} | "
                     f"{us_cell(r, 'pyg+stitchflow')} | {_ratio(r, 'torch_geometric', 'pyg+stitchflow')} |")
    lines += failure_lines(rows, RUNNERS, "eager")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="stitchflow bench gnn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help="app:dataset pairs (app zoo names)")
    parser.add_argument("--out", default="bench-results", help="folder for gnn.json and gnn.csv")
    parser.add_argument("--markdown", default="", help="file whose GNN section is rewritten (BENCHMARKS.md)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("stitchflow bench gnn needs a CUDA GPU")
    copy_bw = copy_bandwidth(torch.device("cuda"))
    rows = run_cases(args.cases.split(","), lambda case: bench_case(case, copy_bw))
    info = device_info("stitchflow bench gnn " + " ".join(argv if argv is not None else []),
                       copy_bw_tbs=copy_bw / 1e12)
    publish(Path(args.out), "gnn", rows, info, markdown(rows, info), SECTION, args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
