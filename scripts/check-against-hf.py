"""kiln against Hugging Face transformers on random-weight checkpoints of any shape of a supported
family, on the GPU machine: the checks the fixtures make, at real shapes and the variations of them
that users bring (head counts, GQA ratios, head dims, windows, tied heads, dtypes, shardings).

usage (on the GPU machine, which has torch and transformers; the binaries are built anywhere):
  python3 scripts/check-against-hf.py --bin DIR CONFIG_JSON [CONFIG_JSON ...] [--layers N]
        [--set KEY=VALUE ...] [--dtype bf16|f16|f32] [--shard-mb MB] [--length L] [--batch B]
        [--work DIR] [--name NAME] [--device cuda|cpu] [--checkpoint-dtype bf16|f16|f32]
        [--generate N]

For each config.json (a real model's, e.g. tests/data/configs/*/config.json), with `--set`
overrides (JSON values: `num_key_value_heads=4`, `sliding_window=128`) and `--layers` layers:
1. transformers builds the model with its own random initialiser (seeded), 2-D weights widened
   by 2.5 as the fixtures' decoders are so that logits are decisive, and saves it as a checkpoint
   of `--checkpoint-dtype` (bf16 unless given; `save_pretrained`, in shards of `--shard-mb` MB);
2. the reference is that checkpoint as a user loads it, in float32 on the same device, eager
   attention, TF32 off;
3. `kiln compile` builds it for CUDA in `--dtype` with one bucket holding the input, and
   `kiln-run forward --device cuda` runs random ids (`--device cpu`: both sides on the CPU, kiln's
   Cranelift kernels) (an encoder's rows padded to lengths spread
   over 1..L, its attention mask zero past them);
4. the outputs are compared as the fixtures' README asks: max |kiln - ref| / max |ref| under 1e-4
   in f32 and 2e-2 in f16/bf16, and, for logits, the argmax of every row equal wherever the
   reference's top-1/top-2 margin exceeds 0.05;
5. in f16 and bf16, transformers itself runs the same checkpoint and inputs in that dtype (eager
   attention, as the reference) and is compared the same way. Over a few thousand wide dot
   products at real shapes its own error can pass the fixtures' tolerance: where it does, kiln
   passes only if its error and its argmax misses are no larger than transformers' own, and the
   line says so.

Prints one line per config; exits 1 if any check fails.
"""
import argparse, inspect, json, os, shutil, subprocess, sys
import torch
from safetensors.torch import load_file, save_file

TOLERANCE = {"f32": 1e-4, "f16": 2e-2, "bf16": 2e-2}
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
MARGIN = 0.05


def parse_value(text):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def config_of(path, layers, overrides):
    cfg = json.load(open(path))
    for item in overrides:
        key, _, value = item.partition("=")
        cfg[key] = parse_value(value)
    if layers is not None:
        cfg["n_layer" if cfg["model_type"] == "gpt2" else "num_hidden_layers"] = layers
    return cfg


def model_class(cfg):
    """transformers' auto class for `cfg`, the keyword arguments its models take, and whether it is
    a decoder (encoders are BertModel without the pooler, as kiln compiles them)."""
    from transformers import AutoModel, AutoModelForCausalLM
    if cfg["model_type"] == "bert":
        return AutoModel, {"add_pooling_layer": False}, False
    return AutoModelForCausalLM, {}, True


def save_checkpoint(cfg, seed, device, ckpt, args):
    """Writes a checkpoint of `cfg` with transformers' random weights; True for a decoder."""
    from transformers import AutoConfig
    cls, extra, decoder = model_class(cfg)
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls.from_config(AutoConfig.for_model(**cfg), **extra).float()
    if decoder:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.mul_(2.5)
    shard = {"max_shard_size": f"{args.shard_mb}MB"} if args.shard_mb else {}
    model.to(DTYPES[args.checkpoint_dtype]).save_pretrained(ckpt, safe_serialization=True, **shard)
    return decoder


def load_reference_model(cfg, ckpt, device, dtype):
    """The checkpoint as a user loads it, in `dtype` (float32 for the reference: its buffers, such
    as RoPE's frequencies, computed in float32 rather than cast from the checkpoint's dtype),
    eager attention."""
    cls, extra, _ = model_class(cfg)
    return cls.from_pretrained(ckpt, dtype=dtype, attn_implementation="eager", **extra).to(device).eval()


def free(device):
    if device == "cuda":
        torch.cuda.empty_cache()


def inputs(cfg, decoder, batch, length, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, cfg["vocab_size"], (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if not decoder:
        for row in range(batch):
            mask[row, max(1, length * (row + 1) // batch):] = 0
        ids = ids * mask
    return ids, mask


def reference(model, decoder, ids, mask, device):
    ids, mask = ids.to(device), mask.to(device)
    with torch.no_grad():
        if decoder:
            return model(input_ids=ids, use_cache=False).logits.float().cpu()
        out = model(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids))
        return out.last_hidden_state.float().cpu()


def greedy(model, ids, steps, device):
    """transformers' greedy tokens after each row of `ids` over its KV cache, and each step's
    top-2 margin."""
    # transformers 5.x names the cache argument `cache`; earlier versions `past_key_values`.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    tokens, margins = [], []
    with torch.no_grad():
        out = model(input_ids=ids.to(device), use_cache=True)
        for step in range(steps):
            top2 = out.logits[:, -1].float().topk(2, dim=-1)
            tokens.append(top2.indices[:, 0])
            margins.append(top2.values[:, 0] - top2.values[:, 1])
            if step + 1 < steps:
                cache = out.cache if hasattr(out, "cache") else out.past_key_values
                out = model(input_ids=tokens[-1][:, None], use_cache=True, **{name: cache})
    return torch.stack(tokens, 1).cpu(), torch.stack(margins, 1).cpu()


def transformers_run(cfg, ckpt, dtype, decoder, ids, mask, args):
    """transformers' outputs for `ids` in `dtype` (eager attention), and with `--generate` its
    greedy tokens and their margins."""
    model = load_reference_model(cfg, ckpt, args.device, DTYPES[dtype])
    out = reference(model, decoder, ids, mask, args.device)
    tokens = greedy(model, ids, args.generate, args.device) if decoder and args.generate > 0 else None
    del model
    free(args.device)
    return out, tokens


def run(cmd, log, stdout=None):
    """Runs `cmd`, its output appended to `log` (its standard output to `stdout` if given)."""
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        if stdout:
            with open(stdout, "w") as out:
                done = subprocess.run(cmd, stdout=out, stderr=f)
        else:
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = open(log).read().strip().splitlines()[-1:]
        raise RuntimeError(f"{os.path.basename(cmd[0])} {cmd[1]} failed: {tail[0] if tail else ''}")


def kiln(args, ckpt, work, decoder, ids, mask):
    """kiln's outputs for `ids`, and with `--generate` its greedy tokens after each row."""
    art, log = f"{work}/artifact", f"{work}/log.txt"
    batch, length = ids.shape
    cmd = [f"{args.bin}/kiln", "compile", ckpt, "-o", art, "--dtype", args.dtype, "--buckets", str(length),
           "--batch-buckets", str(batch), "--target", args.device]
    generate = decoder and args.generate > 0
    if generate:
        cmd += ["--max-context", str(length + args.generate)]
    run(cmd, log)
    feed = {"input_ids": ids.contiguous()}
    if not decoder:
        feed["attention_mask"] = mask.contiguous()
    save_file(feed, f"{work}/in.safetensors")
    run([f"{args.bin}/kiln-run", "forward", art, "--input", f"{work}/in.safetensors", "--output",
         f"{work}/out.safetensors", "--device", args.device], log)
    out = load_file(f"{work}/out.safetensors")
    out = out["logits" if decoder else "last_hidden_state"].float()
    if not generate:
        return out, None
    prompts = [a for row in ids.tolist() for a in ("--prompt-ids", ",".join(map(str, row)))]
    run([f"{args.bin}/kiln-run", "generate", art, *prompts, "--max-new-tokens", str(args.generate),
         "--json", "--device", args.device], log, stdout=f"{work}/generated.jsonl")
    rows = [json.loads(line)["tokens"] for line in open(f"{work}/generated.jsonl")]
    return out, torch.tensor(rows)


class Errors:
    """`got` against the reference: max |got - ref| / max |ref| over the real tokens and, for
    logits, how many decisive rows (top-2 margin over MARGIN) have another argmax."""

    def __init__(self, got, ref, decoder, mask):
        keep = mask.bool()
        got, ref = got.reshape(ref.shape)[keep], ref[keep]
        self.rel = ((got - ref).abs().max() / ref.abs().max()).item()
        self.misses = self.decisive = None
        if decoder:
            top2 = ref.topk(2, dim=-1).values
            decisive = (top2[:, 0] - top2[:, 1]) > MARGIN
            same = (got.argmax(-1) == ref.argmax(-1))[decisive]
            self.decisive, self.misses = int(decisive.sum()), int((~same).sum())

    def __str__(self):
        argmax = f", argmax {self.decisive - self.misses}/{self.decisive} decisive rows" if self.decisive is not None else ""
        return f"rel err {self.rel:.2e}{argmax}"

    def within(self, tolerance):
        return self.rel < tolerance and not self.misses

    def within_peer(self, tolerance, peer):
        """Within the tolerance or `peer`'s error, whichever is larger, missing no more rows."""
        return (self.rel < tolerance or self.rel <= peer.rel) and (self.misses or 0) <= (peer.misses or 0)


def verdict(kiln, peer, dtype):
    """Whether kiln passes, and the line's account: the fixtures' tolerance, or, where
    transformers in the same dtype misses it too, transformers' own error as the bound."""
    line = f"{kiln} (tolerance {TOLERANCE[dtype]:.0e})"
    if peer is None:
        return kiln.within(TOLERANCE[dtype]), line
    line += f"; transformers in {dtype}: {peer}"
    if kiln.within(TOLERANCE[dtype]):
        return True, line
    if not peer.within(TOLERANCE[dtype]) and kiln.within_peer(TOLERANCE[dtype], peer):
        return True, line + f" (outside the tolerance, within transformers' own {dtype} error)"
    return False, line


def agreed(tokens, ref):
    """How many leading tokens of each row equal the reference's."""
    same = (tokens == ref).int()
    return same.cumprod(dim=1).sum(dim=1)


def greedy_verdict(kiln_tokens, ref, peer_tokens, dtype):
    """Whether kiln's greedy tokens follow the reference's (`ref`: its tokens and margins): all of
    them, or up to a step where the reference's top-2 margin is MARGIN or less (a tie may go
    either way, and the histories part there), or, where transformers in the same dtype
    (`peer_tokens`) leaves the reference sooner at a decisive step, at least as far as it goes."""
    ref_tokens, margins = ref
    steps = ref_tokens.shape[1]

    def followed(tokens):
        n = agreed(tokens, ref_tokens)
        at_tie = margins.gather(1, n.clamp(max=steps - 1)[:, None])[:, 0] <= MARGIN
        return n, (n == steps) | at_tie

    n, ok = followed(kiln_tokens)
    line = f"greedy {int(n.sum())}/{n.numel() * steps} tokens as the reference's"
    if peer_tokens is not None:
        peer, peer_ok = followed(peer_tokens)
        line += f" (transformers in {dtype}: {int(peer.sum())})"
        leaning = ~ok & ~peer_ok & (n >= peer)
        if leaning.any():
            line += f" ({int(leaning.sum())} row(s) parting at a decisive step, no sooner than transformers')"
        ok = ok | leaning
    return bool(ok.all()), line


def check(args, path, index):
    cfg = config_of(path, args.layers, args.set)
    name = args.name or os.path.basename(os.path.dirname(os.path.abspath(path)))
    work = f"{args.work}/{index}-{name}"
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    ckpt = f"{work}/checkpoint"
    decoder = save_checkpoint(cfg, index, args.device, ckpt, args)
    ids, mask = inputs(cfg, decoder, args.batch, args.length, seed=1000 + index)
    ref, ref_tokens = transformers_run(cfg, ckpt, "f32", decoder, ids, mask, args)
    peer = peer_tokens = None
    if args.dtype != "f32":
        peer_out, peer_greedy = transformers_run(cfg, ckpt, args.dtype, decoder, ids, mask, args)
        peer = Errors(peer_out, ref, decoder, mask)
        peer_tokens = peer_greedy[0] if peer_greedy is not None else None
    got, tokens = kiln(args, ckpt, work, decoder, ids, mask)
    ok, line = verdict(Errors(got, ref, decoder, mask), peer, args.dtype)
    if tokens is not None:
        generated, greedy_line = greedy_verdict(tokens, ref_tokens, peer_tokens, args.dtype)
        ok, line = ok and generated, f"{line}; {greedy_line}"
    elif args.generate > 0:
        line += "; no greedy tokens (an encoder)"
    shards = len([f for f in os.listdir(ckpt) if f.endswith(".safetensors")])
    what = " ".join(args.set) or "as released"
    print(f"{'ok  ' if ok else 'FAIL'} {name} ({what}; {cfg.get('num_hidden_layers', cfg.get('n_layer'))} layers, "
          f"{shards} {args.checkpoint_dtype} shard(s), {args.dtype}, {args.batch} x {args.length}): {line}", flush=True)
    if ok:
        shutil.rmtree(ckpt)
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--bin", required=True, help="the folder holding the kiln and kiln-run binaries")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--dtype", default="bf16", choices=sorted(TOLERANCE))
    ap.add_argument("--shard-mb", type=int)
    ap.add_argument("--checkpoint-dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--length", type=int, default=300)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--work", default="/tmp/kiln-check")
    ap.add_argument("--name")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--generate", type=int, default=0, metavar="N",
                    help="decoders: also compare N greedy tokens after each row (kiln-run generate)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    failed = 0
    for i, path in enumerate(args.configs):
        try:
            failed += not check(args, path, i)
        except Exception as e:  # one line per failing config, then the next
            print(f"FAIL {path}: {type(e).__name__}: {e}", flush=True)
            failed += 1
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
