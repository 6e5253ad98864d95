"""Block-sparse attention on the device: every autotuned tile config the kernel may pick (unsplit and split),
the app's BigBird attention and decoder against float64, the heads merged by the kernel's store, a split plan
replayed from a CUDA graph, and the mask changed in place (needs a CUDA GPU)."""

import copy
import math

import pytest
import torch

import stitchflow
from stitchflow.apps.bigbird import bigbird_block_mask
from stitchflow.apps.gpt3 import GPT3, BlockSparseAttention, _mask_tensor
from stitchflow.targets.gpu.attention import AttentionStep, candidates, narrow_offsets
from stitchflow.targets.gpu.attention_kernel import Operand, launch
from stitchflow.targets.gpu.attention_plan import tile_plan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("chunk", [0, 4])
@pytest.mark.parametrize("dtype,D,tiles", [(dt, d, t) for dt in (torch.bfloat16, torch.float32) for d in (64, 128)
                                           for t in candidates(dt, d)])
def test_every_candidate_tile_config(dtype, D, tiles, chunk):
    """Unsplit and with query tiles split into runs of 4 key tiles (S = 1000: the last query tile partial)."""
    tiles = tiles.chunked(chunk)
    g = torch.Generator("cuda").manual_seed(0)
    B, H, S = 2, 3, 1000
    q, k, v = (torch.randn(B, H, S, D, device="cuda", generator=g).to(dtype) for _ in range(3))
    mask = bigbird_block_mask(1024, 32, seed=2).dense_mask()[:S, :S].cuda()
    a, b = 1 / math.sqrt(D), torch.where(mask > 0, 0.0, float("-inf"))
    ops = [Operand(t, 0, tuple(t.stride()[:2]), t.stride(2), t.stride(3)) for t in (q, k, v)]
    out = torch.empty_like(q)
    plan = tile_plan(a, b.cpu(), tiles, narrow_offsets(dtype, D, tiles)).to("cuda")  # as AttentionStep plans
    launch(*ops, out, (B, H), plan, S, S, D, D, "ieee")
    s = (q.double() @ k.double().transpose(-1, -2)) * a + b.double()
    ref = torch.softmax(s, -1) @ v.double()
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_bigbird_attention_autotuned(dtype, causal):
    seq, heads, width = 1024, 4, 256
    model = BlockSparseAttention(width, heads, _mask_tensor(bigbird_block_mask(seq, 64, seed=0), seq, causal,
                                                            dtype)).to("cuda", dtype)
    x = torch.randn(2, seq, 3 * width, device="cuda", dtype=dtype)
    prog = stitchflow.compile(model, (x,), target="gpu", fusion="full")
    assert [s for c in prog.compiled for s in c.steps if isinstance(s, AttentionStep)]
    reference = BlockSparseAttention(width, heads, model.mask.double()).cuda()
    for _ in range(2):
        x = torch.randn(2, seq, 3 * width, device="cuda", dtype=dtype)
        assert rel_err(prog(x), reference(x.double())) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_split_plan_in_a_cuda_graph_writing_the_merged_heads():
    """The autotuned S = 4096 BigBird plan splits its global rows; a CUDA-graph replay of the program (the
    scratch allocated once, nothing read back at launch) equals eager on fresh inputs."""
    seq, heads, width = 4096, 2, 128
    model = BlockSparseAttention(width, heads, _mask_tensor(bigbird_block_mask(seq, 64, seed=0), seq, False,
                                                            torch.bfloat16)).to("cuda", torch.bfloat16)
    x = torch.randn(1, seq, 3 * width, device="cuda", dtype=torch.bfloat16)
    prog = stitchflow.compile(model, (x,), target="gpu", fusion="full",
                              options={"cuda_graphs": "always", "attention_tiles": (64, 64, 4, 2, 16)})
    (step,) = [s for c in prog.compiled for s in c.steps if isinstance(s, AttentionStep)]
    reference = BlockSparseAttention(width, heads, model.mask.double()).cuda()
    for _ in range(4):
        x = torch.randn(1, seq, 3 * width, device="cuda", dtype=torch.bfloat16)
        assert rel_err(prog(x), reference(x.double())) < 2e-2
    assert step.store is not None and "split into" in step.describe()


def test_gpt3_decoder_with_bigbird_attention():
    model = GPT3(num_layers=2, width=256, heads=4, ffn=1024, seq=512, block=32).cuda()
    x = torch.randn(1, 512, 256, device="cuda")
    prog = stitchflow.compile(model, (x,), target="gpu", fusion="auto")
    steps = [s for c in prog.compiled for s in c.steps if isinstance(s, AttentionStep)]
    assert len(steps) == 2
    assert rel_err(prog(x), copy.deepcopy(model).double()(x.double())) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_mask_of_the_call(dtype):
    class Padded(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return torch.softmax(q @ k.transpose(-1, -2) * 0.125 + mask[:, None, None, :], -1) @ v

    q, k, v = (torch.randn(4, 8, 500, 64, device="cuda", dtype=dtype) for _ in range(3))
    lengths = torch.tensor([500, 321, 64, 1], device="cuda")
    mask = torch.where(torch.arange(500, device="cuda")[None, :] < lengths[:, None], 0.0, float("-inf")).to(dtype)
    prog = stitchflow.compile(Padded(), (q, k, v, mask), target="gpu", fusion="full")
    assert [s for c in prog.compiled for s in c.steps if isinstance(s, AttentionStep)]
    ref = Padded()(*(t.double() for t in (q, k, v, mask)))
    assert rel_err(prog(q, k, v, mask), ref) < (1e-5 if dtype == torch.float32 else 2e-2)
