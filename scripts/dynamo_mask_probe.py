"""Device probe (debugging aid): the Dynamo graph of nanoGPT's masked attention on this machine's torch, with each
example input's static marking, and what the attention rewrite finds in it. Not a test."""
import torch

from stitchflow.frontend import attention_rewrite as ar
from tests.frontend.test_attention_rewrite import NanoGPTAttention, dynamo_graph, qkv

q, k, v = qkv((2, 3))
gm, example = dynamo_graph(NanoGPTAttention(12), q, k, v)
print(gm.graph)
for node, value in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example):
    print(node.name, type(value).__name__, getattr(value, "_dynamo_static_input_type", None))
found, refused = ar.find(gm, example)
print(found, refused)
att = found[0]
print("mask nodes:", ar._mask_nodes(att.mask))
