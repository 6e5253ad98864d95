"""Device check: ops the frontend lowered in session 15 (var, std, amin, norm, max/min over a dim with
their indices, argmax, activations, pools, gather, embedding, rounding, sin/cos, log1p/expm1) and
NaN-keeping maxima, through the gpu target on CUDA tensors, against eager; large column reductions take the
TMA-fed (Gluon) pieces. Then small models through torch.compile(backend="stitchflow") on CUDA. Not a test
(the CPU tests run the same kernels under the interpreter); prints one line per case, exits 1 on a mismatch.

    PYTHONPATH=. python3 scripts/reductions_device_check.py
"""
import sys

import torch
import torch.nn.functional as F

import stitchflow

CASES = {
    "column amax": lambda x: x / x.amax(0),
    "column max(dim)": lambda x: x.max(0),
    "row argmax": lambda x: x.argmax(-1),
    "column std": lambda x: (x - x.mean(0)) / x.std(0),
    "row var, amin": lambda x: x.var(-1, keepdim=True) + x.amin(-1, keepdim=True),
    "norm": lambda x: x / x.norm(dim=-1, keepdim=True),
    "relu, maximum": lambda x: torch.maximum(x, x[:, :1]).relu(),
    "activations": lambda x: F.hardswish(x) + F.mish(x) + F.softplus(x) + F.elu(x) + F.leaky_relu(x, 0.1),
    "pools": lambda x: F.max_pool2d(x[None], 2)[0] + F.avg_pool1d(x[:, None], 4)[:, 0].sum(),
    "rounding, sin, log1p": lambda x: (x * 4).round() + torch.floor(x) - x.ceil() + torch.sin(x) * torch.cos(x)
    + torch.log1p(x.abs()) - torch.expm1(x * 1e-3),
    "gather, glu": lambda x: torch.gather(F.glu(x[:, :256], -1), 1, torch.zeros_like(x[:, :3], dtype=torch.long)) * 2,
}


def main() -> int:
    bad = 0
    for shape in ((65536, 1024), (333, 257)):
        for nan in (False, True):
            x = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
            if nan:
                x[5, 7] = x[100 % shape[0], 200 % shape[1]] = float("nan")
            for name, fn in CASES.items():
                prog = stitchflow.compile(fn, (x,), target="gpu", fusion="full", options={"cuda_graphs": False})
                out, ref = prog(x), fn(x)
                outs = out if isinstance(out, (tuple, list)) else (out,)
                refs = ref if isinstance(ref, (tuple, list)) else (ref,)
                ok = all(o.shape == r.shape and o.dtype == r.dtype and torch.allclose(
                    o.float(), r.float(), rtol=1e-4, atol=1e-5, equal_nan=True) for o, r in zip(outs, refs))
                bad += not ok
                print(f"{shape} nan={nan} {name}: {'ok' if ok else 'MISMATCH'}", flush=True)
    return 1 if bad + models() else 0


class Cnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.hardswish(self.bn(self.conv(x))), 2)
        return F.log_softmax(self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1).repeat(1, 16)), -1).max(-1)


class Tagger(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.norm, self.out = torch.nn.Embedding(100, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 5)

    def forward(self, tokens):
        h = self.norm(self.emb(tokens))
        return self.out(F.glu(torch.cat([h, h], -1), -1)).argmax(-1), h.std(-1)


def models() -> int:
    """Models through the backend on CUDA: equal to eager, whatever ran eagerly."""
    import stitchflow.backend as backend

    bad = 0
    cases = [(Cnn().eval(), torch.randn(4, 3, 8, 8)), (Tagger().eval(), torch.randint(0, 100, (4, 9)))]
    for model, x in cases:
        torch._dynamo.reset()
        model, x = model.cuda(), x.cuda()
        with torch.no_grad():
            out, ref = torch.compile(model, backend="stitchflow")(x), model(x)
        ok = all(torch.allclose(o.float(), r.float(), rtol=1e-3, atol=1e-4) for o, r in zip(out, ref))
        bad += not ok
        print(f"backend {type(model).__name__}: {'ok' if ok else 'MISMATCH'}", flush=True)
    print(backend.fallback_report())
    return bad


if __name__ == "__main__":
    sys.exit(main())
