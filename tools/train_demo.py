"""Train moefit's bundled demo model from scratch: a small Qwen3-MoE on WordNet's glosses.

    apt-get install wordnet-base        # WordNet 3.0, the WordNet licence (see MODEL_CARD.md)
    .venv/bin/python tools/train_demo.py --steps 3000 --out moefit/demo/model

Reproducible: fixed seed, fixed corpus order; writes a standard HF checkpoint (bf16
safetensors, config.json, tokenizer.json, chat template) and MODEL_CARD.md.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import random
import re
import time
from pathlib import Path

import torch

WORDNET = Path("/usr/share/wordnet")
POS = {"noun": "noun", "verb": "verb", "adj": "adjective", "adv": "adverb"}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The format the chat documents are trained in; the shipped model/chat_template.jinja is Qwen3's
# template (Apache-2.0), which renders these turns identically and adds tools and tool calls.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def synsets():
    """(pos, words, definition, examples) for every WordNet synset."""
    for suffix, pos in POS.items():
        for line in (WORDNET / f"data.{suffix}").read_text(encoding="latin-1").splitlines():
            if line.startswith("  ") or "|" not in line:
                continue                                  # the licence header
            head, gloss = line.split("|", 1)
            fields = head.split()
            words = [fields[4 + 2 * i].replace("_", " ") for i in range(int(fields[3], 16))]
            words = [re.sub(r"\(.*\)$", "", w) for w in words]
            parts = [p.strip() for p in gloss.strip().split(";")]
            definition = parts[0]
            examples = [p.strip('"') for p in parts[1:] if p.startswith('"')]
            yield pos, words, definition, examples


def documents(seed: int) -> list[str]:
    """Each synset as a definition; half plain text, half chat turns."""
    rng = random.Random(seed)
    docs = []
    for pos, words, definition, examples in synsets():
        word = words[0]
        answer = f"{word} ({pos}): {definition}."
        if examples:
            answer += f' For example: "{examples[0]}".'
        if len(words) > 1:
            answer += f" Also: {', '.join(words[1:4])}."
        if rng.random() < 0.5:
            docs.append(f"Define: {word}\n{answer}<|endoftext|>")
        else:
            docs.append(f"<|im_start|>user\nDefine: {word}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"
                        "<|endoftext|>")
    rng.shuffle(docs)
    return docs


def corpus_hash() -> str:
    h = hashlib.sha256()
    for suffix in POS:
        h.update((WORDNET / f"data.{suffix}").read_bytes())
    return h.hexdigest()


def train_tokenizer(docs: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    return tok


def model_config(vocab: int, args):
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                          moe_intermediate_size=args.expert_size, num_hidden_layers=args.layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=args.experts,
                          num_experts_per_tok=args.top_k, norm_topk_prob=True, max_position_embeddings=2048,
                          rope_theta=10000.0, tie_word_embeddings=True, output_router_logits=True,
                          router_aux_loss_coef=0.01, bos_token_id=None, eos_token_id=[0, 2], pad_token_id=0)


def batches(ids: list[int], seq: int, batch: int, rng: random.Random):
    starts = list(range(0, len(ids) - seq - 1, seq))
    while True:
        rng.shuffle(starts)
        for i in range(0, len(starts) - batch + 1, batch):
            rows = [ids[s:s + seq + 1] for s in starts[i:i + batch]]
            yield torch.tensor(rows)


@torch.no_grad()
def evaluate(model, ids: list[int], seq: int) -> tuple[float, torch.Tensor]:
    """Mean validation loss and per-layer expert routing counts."""
    model.eval()
    losses, counts = [], None
    for s in range(0, min(len(ids) - seq - 1, 200 * seq), seq):
        x = torch.tensor([ids[s:s + seq + 1]])
        out = model(x[:, :-1], labels=x[:, :-1].clone(), output_router_logits=True)
        logits = out.logits[0, :-1]
        losses.append(torch.nn.functional.cross_entropy(logits, x[0, 1:-1]).item())
        top = torch.stack([r.topk(model.config.num_experts_per_tok, -1).indices for r in out.router_logits])
        c = torch.stack([torch.bincount(layer.flatten(), minlength=model.config.num_experts) for layer in top])
        counts = c if counts is None else counts + c
    model.train()
    return sum(losses) / len(losses), counts


def unigram_perplexity(train: list[int], val: list[int], vocab: int) -> float:
    counts = torch.bincount(torch.tensor(train), minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    return math.exp(-logp[torch.tensor(val)].mean().item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="moefit/demo/model")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-size", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    docs = documents(args.seed)
    split = len(docs) // 50
    tok = train_tokenizer(docs[split:], args.vocab)
    encode = lambda ds: [t for d in ds for t in tok.encode(d).ids]  # noqa: E731
    train_ids, val_ids = encode(docs[split:]), encode(docs[:split])
    print(f"corpus: {len(docs)} documents, {len(train_ids)} train tokens, {len(val_ids)} validation tokens",
          flush=True)

    from transformers import Qwen3MoeForCausalLM
    model = Qwen3MoeForCausalLM(model_config(tok.get_vocab_size(), args))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1, (s + 1) / warmup) *
                                              0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    data = batches(train_ids, args.seq, args.batch, random.Random(args.seed))
    log, t0 = [], time.time()
    for step in range(1, args.steps + 1):
        x = next(data)
        loss = model(x[:, :-1], labels=x[:, :-1].clone()).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == 1:
            log.append({"step": step, "loss": round(loss.item(), 4), "s": round(time.time() - t0)})
            print(json.dumps(log[-1]), flush=True)
    val_loss, counts = evaluate(model, val_ids, args.seq)
    save(model, tok, out, args, log, val_loss, counts, len(docs), args.steps * args.batch * args.seq,
         unigram_perplexity(train_ids, val_ids, tok.get_vocab_size()), time.time() - t0, docs)


def save(model, tok, out: Path, args, log, val_loss, counts, n_docs, tokens_seen, unigram_ppl, seconds, docs):
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": 2048}, indent=1))
    words = sorted({w for d in docs for w in re.findall(r"[a-z]+", d.lower())})
    with gzip.open(out / "corpus_words.txt.gz", "wt") as f:
        f.write("\n".join(words))
    skew = [(c.sort(descending=True).values[: max(1, len(c) // 4)].sum() / c.sum()).item() for c in counts]
    card = render_card(args, log, val_loss, skew, counts, n_docs, tokens_seen, unigram_ppl, seconds)
    (out / "MODEL_CARD.md").write_text(card)
    print(card)


def render_card(args, log, val_loss, skew, counts, n_docs, tokens_seen, unigram_ppl, seconds) -> str:
    usage = "\n".join(f"| {i} | {100 * s:.0f}% | {' '.join(str(int(v)) for v in c.tolist())} |"
                      for i, (s, c) in enumerate(zip(skew, counts)))
    curve = ", ".join(f"{e['step']}: {e['loss']}" for e in log[:: max(1, len(log) // 10)])
    return f"""# moefit demo model: a small Qwen3-MoE trained on WordNet glosses

- Architecture: Qwen3-MoE, {args.layers} layers, hidden {args.hidden}, 4 heads x 64 (2 KV heads),
  {args.experts} experts per layer, top-{args.top_k}, expert size {args.expert_size}, vocabulary {args.vocab}
  (byte-level BPE trained on the corpus), tied embeddings, bf16 weights.
- Corpus: the glosses and example sentences of WordNet 3.0 (Debian package `wordnet-base`,
  /usr/share/wordnet/data.{{noun,verb,adj,adv}}), {n_docs} synsets as "Define: word" documents, half of
  them as chat turns. Licence: the WordNet 3.0 licence (Princeton University; permission to use, copy,
  modify and distribute, with the copyright notice kept). sha256 of the four data files:
  {corpus_hash()}.
- Training: {args.steps} steps x {args.batch} x {args.seq} tokens = {tokens_seen:,} tokens seen, AdamW
  lr {args.lr} (warm-up then cosine), router aux loss 0.01, seed {args.seed}, {args.threads} CPU threads,
  {seconds / 60:.0f} minutes. Reproduce: `python tools/train_demo.py --steps {args.steps}`.
- Training loss by step: {curve}.
- Validation (2 % of synsets, held out): loss {val_loss:.3f}, perplexity {math.exp(val_loss):.1f};
  a unigram model of the training tokens: perplexity {unigram_ppl:.1f}.
- Expert usage on the validation set: share of routings that go to each layer's hottest quarter of
  experts (uniform routing would give 25 %), and the count per expert:

| layer | top quarter | routings per expert |
|---|---|---|
{usage}
"""


if __name__ == "__main__":
    main()
