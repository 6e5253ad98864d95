"""FuseFlow's two GNN workloads, written so that torch.fx sees every op FuseFlow fuses.

GCN:       softmax(A · relu(A · X · W1 + b1) · W2 + b2)
GraphSAGE: relu(X · Wself + (A · X) · Wneigh + b), per layer

Each layer is its own submodule (``layer1``, ``layer2``, ...) because FuseFlow's best GNN
configuration is per-layer partial fusion: the planner can take the ``nn_module_stack`` of
traced nodes as the natural region boundaries. The forward bodies use plain ``@`` and no
Python branches on tensor properties, so the same code runs eagerly with a dense, CSR or COO
adjacency and traces symbolically. Weights are 50% sparse, stored dense with explicit zeros;
``param_formats`` tells the frontend which parameters to compress (DCSR) as FuseFlow does.
"""

from __future__ import annotations

import torch
from torch import nn

from .common import collect_param_formats, make_generator, small_uniform, sparse_weight

ACTIVATIONS = ("relu", "softmax", "none")


def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """Apply a layer's activation; ``activation`` is a constructor constant, so this traces."""
    if activation == "relu":
        return torch.relu(h)
    if activation == "softmax":
        return torch.softmax(h, dim=-1)
    return h


def _check_activation(activation: str) -> str:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return activation


class GCNLayer(nn.Module):
    """act(A·X·W + b). `association` "ax_w" computes (A·X)·W, the order under which a fused
    layer streams A's rows without recomputation (FuseFlow's finding that per-layer fusion
    wins needs it); "a_xw" computes A·(X·W), fewer FLOPs unfused but a fused layer then
    recomputes X·W for every non-zero of A."""

    def __init__(self, in_features: int, out_features: int, activation: str = "relu",
                 weight_density: float = 0.5, generator: torch.Generator | None = None,
                 dtype: torch.dtype = torch.float32, association: str = "ax_w"):
        super().__init__()
        if association not in ("ax_w", "a_xw"):
            raise ValueError(f"association must be 'ax_w' or 'a_xw', got {association!r}")
        self.association = association
        gen = generator if generator is not None else make_generator(0)
        self.activation = _check_activation(activation)
        self.weight = nn.Parameter(sparse_weight(in_features, out_features, weight_density,
                                                 gen, dtype))
        self.bias = nn.Parameter(small_uniform((out_features,), gen, dtype=dtype))

    def forward(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = (a @ x) @ self.weight if self.association == "ax_w" else a @ (x @ self.weight)
        h = h + self.bias
        return activate(h, self.activation)


class SAGELayer(nn.Module):
    """act(X · Wself + (A · X) · Wneigh + b): sum aggregation over the 0/1 adjacency."""

    def __init__(self, in_features: int, out_features: int, activation: str = "relu",
                 weight_density: float = 0.5, generator: torch.Generator | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        gen = generator if generator is not None else make_generator(0)
        self.activation = _check_activation(activation)
        self.weight_self = nn.Parameter(sparse_weight(in_features, out_features,
                                                      weight_density, gen, dtype))
        self.weight_neigh = nn.Parameter(sparse_weight(in_features, out_features,
                                                       weight_density, gen, dtype))
        self.bias = nn.Parameter(small_uniform((out_features,), gen, dtype=dtype))

    def forward(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h_self = x @ self.weight_self
        h_neigh = (a @ x) @ self.weight_neigh
        h = h_self + h_neigh + self.bias
        return activate(h, self.activation)


class _StackedGNN(nn.Module):
    """Layers ``layer1..layerN`` applied in turn to (A, H); the loop unrolls when traced."""

    layer_cls: type[nn.Module] = GCNLayer
    sparse_params: tuple[str, ...] = ("weight",)

    def __init__(self, in_features: int, hidden: int, out_features: int, num_layers: int,
                 activations: tuple[str, ...], weight_density: float, seed: int,
                 dtype: torch.dtype):
        super().__init__()
        if num_layers < 1 or len(activations) != num_layers:
            raise ValueError("need num_layers >= 1 and one activation per layer")
        gen = make_generator(seed)
        sizes = [in_features] + [hidden] * (num_layers - 1) + [out_features]
        self.num_layers = num_layers
        for i in range(num_layers):
            layer = self.layer_cls(sizes[i], sizes[i + 1], activations[i], weight_density,
                                   gen, dtype)
            self.add_module(f"layer{i + 1}", layer)
        self.param_formats: dict[str, str] = collect_param_formats(self, self.sparse_params)

    def layers(self) -> list[nn.Module]:
        return [getattr(self, f"layer{i + 1}") for i in range(self.num_layers)]

    def forward(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.layers():
            h = layer(a, h)
        return h


class GCN(_StackedGNN):
    """Kipf–Welling GCN as FuseFlow runs it: unnormalised 0/1 adjacency, softmax output.

    Defaults are FuseFlow's (2 layers, hidden 16) sized for Cora (1,433 → 7 classes).
    ``last_activation`` is "softmax" per workloads.md; hidden layers use ReLU.
    """

    layer_cls = GCNLayer
    sparse_params = ("weight",)

    def __init__(self, in_features: int = 1433, hidden: int = 16, out_features: int = 7,
                 num_layers: int = 2, weight_density: float = 0.5, seed: int = 0,
                 dtype: torch.dtype = torch.float32, last_activation: str = "softmax",
                 association: str = "ax_w"):
        acts = ("relu",) * (num_layers - 1) + (last_activation,)
        super().__init__(in_features, hidden, out_features, num_layers, acts, weight_density,
                         seed, dtype)
        for layer in self.layers():  # see GCNLayer: (A·X)·W streams, A·(X·W) recomputes when fused
            if association not in ("ax_w", "a_xw"):
                raise ValueError(f"association must be 'ax_w' or 'a_xw', got {association!r}")
            layer.association = association


class GraphSAGE(_StackedGNN):
    """GraphSAGE (sum aggregator) as FuseFlow runs it: ReLU after every layer by default."""

    layer_cls = SAGELayer
    sparse_params = ("weight_self", "weight_neigh")

    def __init__(self, in_features: int = 1433, hidden: int = 16, out_features: int = 7,
                 num_layers: int = 2, weight_density: float = 0.5, seed: int = 0,
                 dtype: torch.dtype = torch.float32, last_activation: str = "relu"):
        acts = ("relu",) * (num_layers - 1) + (last_activation,)
        super().__init__(in_features, hidden, out_features, num_layers, acts, weight_density,
                         seed, dtype)
