"""PyTorch peer for kiln's CPU MiniLM throughput: Hugging Face transformers' BertModel on the CPU
(f32, every core torch sees), mean pooling over the attention mask and L2 normalisation as
sentence-transformers does, on random token ids. Prints one JSON line.

usage: python3 peer-minilm-cpu.py MODEL_DIR [--batch 32] [--seq 128] [--iters 20]"""
import argparse, json, time

import torch
from transformers import AutoModel

p = argparse.ArgumentParser()
p.add_argument("model_dir")
p.add_argument("--batch", type=int, default=32)
p.add_argument("--seq", type=int, default=128)
p.add_argument("--iters", type=int, default=20)
a = p.parse_args()

model = AutoModel.from_pretrained(a.model_dir, torch_dtype=torch.float32).eval()
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, model.config.vocab_size, (a.batch, a.seq), generator=g)
mask = torch.ones_like(ids)


def embed():
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    m = mask.unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


with torch.inference_mode():
    for _ in range(3):
        embed()
    times = []
    for _ in range(a.iters):
        t0 = time.perf_counter()
        embed()
        times.append(time.perf_counter() - t0)
times.sort()
median = times[len(times) // 2]
print(json.dumps({
    "peer": "torch+transformers eager, f32, CPU",
    "torch": torch.__version__,
    "threads": torch.get_num_threads(),
    "batch": a.batch,
    "seq": a.seq,
    "median_ms": median * 1e3,
    "sentences_per_s": a.batch / median,
}))
