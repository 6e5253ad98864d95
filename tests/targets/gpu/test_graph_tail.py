"""The gpu target's graph tail (`GpuTarget.graph_tail`): a program's trailing GEMMs that make large outputs run
after a CUDA-graph replay instead of inside it, so that their outputs are not cloned out of the graph's buffers.
The split is checked here on the CPU; the replay itself in test_cuda_graphs.py."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import stitchflow  # noqa: E402
from stitchflow.targets.gpu import TARGET, TorchStep  # noqa: E402


class Head(torch.nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.norm, self.head = torch.nn.LayerNorm(32), torch.nn.Linear(32, vocab, bias=False)

    def forward(self, x):
        return self.head(self.norm(x))


def test_the_last_gemm_of_a_large_output_is_the_tail():
    x = torch.randn(64, 32)
    model = Head(131072).eval()  # 64 x 131072 float32: 32 MiB
    prog = stitchflow.compile(model, (x,), target="gpu", fusion="auto")
    head, (names, tail) = TARGET.graph_tail(prog.graph, prog.compiled)
    (out,) = prog.graph.outputs
    assert names == (out,) and len(head) == len(prog.compiled)
    assert not any(isinstance(s, TorchStep) and s.node.name == out for run in head for s in run.steps)
    env = prog._run(prog._bind((x,)), head)
    assert out not in env
    tail(env)
    torch.testing.assert_close(env[out], model(x), rtol=1e-4, atol=1e-4)


class HeadAndMore(Head):
    """The head's output, and work after it: a sum of the normed rows (returned), or the head's log-softmax."""

    def __init__(self, vocab, reads_logits: bool):
        super().__init__(vocab)
        self.reads_logits = reads_logits

    def forward(self, x):
        logits = self.head(self.norm(x))
        if self.reads_logits:
            return logits, logits.log_softmax(-1)
        return logits, self.norm(x * 2).sum(-1)


def test_a_gemm_whose_output_nothing_after_reads_leaves_the_graph():
    x = torch.randn(64, 32)
    model = HeadAndMore(131072, reads_logits=False).eval()
    prog = stitchflow.compile(model, (x,), target="gpu", fusion="auto")
    head, (names, tail) = TARGET.graph_tail(prog.graph, prog.compiled)
    assert names == (prog.graph.outputs[0],)
    env = prog._run(prog._bind((x,)), head)
    tail(env)
    for name, want in zip(prog.graph.outputs, model(x)):
        torch.testing.assert_close(env[name], want, rtol=1e-4, atol=1e-4)
    prog = stitchflow.compile(HeadAndMore(131072, reads_logits=True).eval(), (x,), target="gpu", fusion="auto")
    assert TARGET.graph_tail(prog.graph, prog.compiled)[1] is None  # the log-softmax reads the logits after


def test_small_outputs_stay_in_the_graph():
    x = torch.randn(64, 32)
    prog = stitchflow.compile(Head(512).eval(), (x,), target="gpu", fusion="auto")
    head, tail = TARGET.graph_tail(prog.graph, prog.compiled)
    assert tail is None and head == list(prog.compiled)


def test_a_gemm_on_an_input_of_the_call_stays_in_the_graph():
    """A replay's environment holds what the graph made, not the call's inputs: a GEMM reading one stays inside."""
    x = torch.randn(64, 32)
    prog = stitchflow.compile(torch.nn.Linear(32, 131072, bias=False).eval(), (x,), target="gpu", fusion="auto")
    assert TARGET.graph_tail(prog.graph, prog.compiled)[1] is None
