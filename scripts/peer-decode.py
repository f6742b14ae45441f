#!/usr/bin/env python3
"""Decode peer for `kiln-run bench --batch B --decode-tokens N`: Hugging Face transformers with a
StaticCache and each decode step captured once as a CUDA graph and replayed, greedy tokens chosen on
the GPU and copied to the host every step (as kiln does). Prints one JSON line per batch size.

    peer-decode.py MODEL_DIR [--batch 1,8] [--prompt 16] [--tokens 256]
"""
import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, StaticCache


def static_cache(model, batch, length):
    try:
        return StaticCache(config=model.config, max_batch_size=batch, max_cache_len=length,
                           device="cuda", dtype=torch.bfloat16)
    except TypeError:  # newer transformers size the cache from its first use
        return StaticCache(config=model.config, max_cache_len=length)


@torch.no_grad()
def measure(model, batch, prompt, tokens):
    vocab = model.config.vocab_size
    cache = static_cache(model, batch, prompt + tokens + 8)
    ids = torch.randint(0, vocab, (batch, prompt), device="cuda")
    out = model(ids, past_key_values=cache, use_cache=True,
                cache_position=torch.arange(prompt, device="cuda"))
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    position = torch.tensor([prompt], device="cuda")

    def step():
        logits = model(token, past_key_values=cache, use_cache=True,
                       cache_position=position).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chosen = step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(tokens):
        graph.replay()
        token.copy_(chosen)
        position += 1
        chosen.cpu()  # the token ids reach the host every step
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000 / tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, torch_dtype=torch.bfloat16)
    model = model.cuda().eval()
    for batch in [int(b) for b in a.batch.split(",")]:
        ms = measure(model, batch, a.prompt, a.tokens)
        print(json.dumps({"peer": "hf_static_cache_cuda_graph", "model": a.model_dir,
                          "batch": batch, "ms_per_step": ms}), flush=True)


if __name__ == "__main__":
    main()
