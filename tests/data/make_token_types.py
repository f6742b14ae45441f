"""References for token types (segment ids), computed by Hugging Face transformers on CPU in
float32, eval mode:

- bert_tiny_token_types.safetensors: the bert-tiny fixture on a right-padded batch whose rows mix
  segments 0 and 1: `input_ids`, `attention_mask`, `token_type_ids` (i64 [3, 13]) and
  `last_hidden_state` (f32 [3, 13, 64]).
- minilm_pairs.safetensors: all-MiniLM-L6-v2 (scripts/fetch-minilm) on the sentence pairs of
  PAIRS, tokenised as pairs by its tokenizer: `input_ids`, `attention_mask`, `token_type_ids`
  (i64 [2, L]) and `sentence_embedding` (f32 [2, 384]: mean over the mask, L2-normalised, as the
  folder's modules.json says).

usage: python make_token_types.py BERT_TINY_DIR MINILM_DIR OUT_DIR
(needs torch, transformers, safetensors)"""
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoTokenizer, BertModel

PAIRS = [
    ("Where is the compiler's output written?", "Into an artifact folder beside the destination."),
    ("short", "A second segment that is a good deal longer than the first one."),
]

torch.set_grad_enabled(False)
print("transformers", transformers.__version__, "torch", torch.__version__)


def bert_tiny(model_dir, out):
    model = BertModel.from_pretrained(model_dir, add_pooling_layer=False).eval().float()
    g = torch.Generator().manual_seed(2024)
    # (real length, where segment 1 starts): rows right-padded to 13 tokens.
    rows = [(13, 6), (7, 3), (10, 10)]
    B, L = len(rows), max(r[0] for r in rows)
    ids = torch.zeros(B, L, dtype=torch.int64)
    mask = torch.zeros(B, L, dtype=torch.int64)
    types = torch.zeros(B, L, dtype=torch.int64)
    for i, (n, second) in enumerate(rows):
        ids[i, :n] = torch.randint(1, model.config.vocab_size, (n,), generator=g)
        mask[i, :n] = 1
        types[i, second:n] = 1
    hidden = model(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    zero = model(input_ids=ids, attention_mask=mask).last_hidden_state
    keep = mask.bool()
    print("bert-tiny: segment effect (max |diff| / max |ref| over real tokens):",
          float((hidden - zero)[keep].abs().max() / hidden[keep].abs().max()))
    save_file({"input_ids": ids, "attention_mask": mask, "token_type_ids": types,
               "last_hidden_state": hidden.contiguous()}, out)


def minilm_pairs(model_dir, out):
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = BertModel.from_pretrained(model_dir, add_pooling_layer=False).eval().float()
    enc = tok([a for a, _ in PAIRS], [b for _, b in PAIRS], padding=True, return_tensors="pt")
    hidden = model(**enc).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).float()
    emb = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    emb = torch.nn.functional.normalize(emb, p=2, dim=1)
    save_file({"input_ids": enc["input_ids"].to(torch.int64).contiguous(),
               "attention_mask": enc["attention_mask"].to(torch.int64).contiguous(),
               "token_type_ids": enc["token_type_ids"].to(torch.int64).contiguous(),
               "sentence_embedding": emb.contiguous()}, out)
    print("minilm pairs:", tuple(enc["input_ids"].shape))


bert_tiny(sys.argv[1], f"{sys.argv[3]}/bert_tiny_token_types.safetensors")
minilm_pairs(sys.argv[2], f"{sys.argv[3]}/minilm_pairs.safetensors")
