"""PyTorch peers of `kiln-run bench` on the GPU machine (Hugging Face transformers, eager or under
torch.compile): the same checkpoint, dtype, batch and lengths, the same output copied to
page-locked host memory (all logits of a decoder, the `last_hidden_state` of an encoder), timed
with CUDA events after warm-up.

usage: python3 scripts/peer-prefill.py MODEL_DIR --lengths 16,128,2048 [--batch B] [--dtype bf16]
                                      [--mode compile|eager]

One JSON line per length: the steady-state median and the first call's wall time (compilation,
under torch.compile).
"""
import argparse, json, time
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from cuda_timing import bench


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--lengths", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    ap.add_argument("--mode", default="compile", choices=["compile", "eager"])
    a = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    cfg = AutoConfig.from_pretrained(a.model)
    decoder = any(x.endswith(("LMHeadModel", "ForCausalLM")) for x in cfg.architectures or [])
    cls = AutoModelForCausalLM if decoder else AutoModel
    model = cls.from_pretrained(a.model, dtype=dtype).cuda().eval()
    compiled = torch.compile(model) if a.mode == "compile" else model
    peer = "torch.compile" if a.mode == "compile" else "hf_eager"
    output = "logits" if decoder else "last_hidden_state"
    for length in [int(x) for x in a.lengths.split(",")]:
        ids = torch.randint(0, cfg.vocab_size, (a.batch, length), device="cuda")
        mask = torch.ones_like(ids)
        kwargs = {"use_cache": False} if decoder else {}
        with torch.no_grad():
            shape = getattr(model(input_ids=ids, attention_mask=mask, **kwargs), output).shape
        host = torch.empty(shape, dtype=dtype, pin_memory=True)

        def run():
            with torch.no_grad():
                out = compiled(input_ids=ids, attention_mask=mask, **kwargs)
            host.copy_(getattr(out, output), non_blocking=True)

        start = time.time()
        run()
        torch.cuda.synchronize()
        first = time.time() - start
        print(json.dumps({"peer": peer, "model": cfg.architectures[0], "batch": a.batch,
                          "len": length, "output": output, "ms": bench(run), "first_call_s": first}),
              flush=True)


if __name__ == "__main__":
    main()
