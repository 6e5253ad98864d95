"""Device probe: a Hugging Face Llama (transformers, attn_implementation="eager", random weights from a config,
no download) trained one step at a time under eager, torch.compile and torch.compile(backend="stitchflow"):
which of its attentions the training path rewrites into torch's fused attention (or why not), and the step
times (CUDA events, medians). Not a test.

    python scripts/hf_attention_probe.py [--layers 2] [--seq 1024] [--width 2048]
"""
import argparse
import copy
import logging
import statistics

import torch

import stitchflow.backend  # noqa: F401  (registers the backend where no entry point is installed)


class _Reasons(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        text = record.getMessage()
        if "attention" in text or "softmax" in text:
            self.lines.append(text)


def _model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=args.width, intermediate_size=int(args.width * 3.5), num_hidden_layers=args.layers,
                      num_attention_heads=args.width // 128, num_key_value_heads=max(1, args.width // 512),
                      max_position_embeddings=args.seq, vocab_size=8192, attn_implementation="eager")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)


def _time(step, n=10):
    for _ in range(3):
        step()
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--width", type=int, default=2048)
    args = p.parse_args()
    reasons = _Reasons()
    logging.getLogger("stitchflow").addHandler(reasons)
    logging.getLogger("stitchflow").setLevel(logging.INFO)
    base = _model(args)
    ids = torch.randint(0, 8192, (1, args.seq), device="cuda")
    runners = {"eager": lambda m: m, "torch.compile": lambda m: torch.compile(m),
               "stitchflow": lambda m: torch.compile(m, backend="stitchflow"),
               "stitchflow attention as written": lambda m: torch.compile(m, backend="stitchflow",
                                                                          options={"attention": False})}
    losses = {}
    for name, make in runners.items():
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        fn = make(model)

        def step():
            model.zero_grad(set_to_none=True)
            loss = fn(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss

        try:
            losses[name] = step().item()
            print(f"{name}: loss {losses[name]:.5f}, step {_time(step):.0f} µs", flush=True)
        except Exception as err:  # a probe: report and go on
            print(f"{name}: failed: {type(err).__name__}: {str(err)[:300]}", flush=True)
    print("stitchflow's attention decisions:")
    for line in dict.fromkeys(reasons.lines):
        print("  ", line[:300])


if __name__ == "__main__":
    main()
