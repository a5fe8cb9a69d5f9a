"""A draft head trained by moefit on the base model's hidden states (Medusa-style, Cai et
al. 2024): head i reads the final hidden state h_t that produced token t+1 and guesses
token t+2+i through the model's own lm_head:  logits_i = lm_head(h + silu(W_i h + b_i)).

Stored in the pack as draft.bin (fp32) with a "draft" section in the header; its device
bytes come out of the reserve, as the ledger says.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from moefit.memory import ledger as L
from moefit.pack.format import HEADER, write_json_atomic

DRAFT_FILE = "draft.bin"


class DraftHead:
    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor]):
        self.weights, self.biases = weights, biases

    @property
    def heads(self) -> int:
        return len(self.weights)

    def hidden(self, h: torch.Tensor, i: int) -> torch.Tensor:
        return h + F.silu(F.linear(h, self.weights[i], self.biases[i]))

    @torch.inference_mode()
    def propose(self, engine, token: int, k: int) -> list[int]:
        """k drafts after `token`: each head's most likely token."""
        h = engine.last_hidden                                                    # [E]
        k = min(k, self.heads)
        logits = torch.stack([engine.model.logits(self.hidden(h, i)[None])[0] for i in range(k)])
        return logits.argmax(-1).tolist()


def draft_params(hidden: int, heads: int) -> int:
    return heads * (hidden * hidden + hidden)


def load_draft_head(pack, loaded) -> DraftHead | None:
    """The pack's draft head on the device, charged to the reserve line."""
    info = pack.draft
    if not info:
        return None
    e, dtype = pack.model.hidden_size, loaded.model.norm.dtype
    raw = torch.from_file(str(pack.path / DRAFT_FILE), size=draft_params(e, info["heads"]), dtype=torch.float32)
    weights, biases, at = [], [], 0
    for _ in range(info["heads"]):
        w, b = raw[at:at + e * e].view(e, e), raw[at + e * e:at + e * e + e]
        weights.append(loaded.mem.copy_in(L.RESERVE, w, dtype))
        biases.append(loaded.mem.copy_in(L.RESERVE, b, dtype))
        at += e * e + e
    return DraftHead(weights, biases)


def collect(engine, tokens: list[int], chunk: int = 256) -> torch.Tensor:
    """Final hidden states [N, E] of the base model over a token stream."""
    states = []
    for start in range(0, len(tokens), chunk):
        piece = tokens[start:start + chunk]
        engine.kv_tokens = []
        engine.forward(piece, 0)
        states.append(engine.hidden.float().cpu())
    return torch.cat(states)


def train(engine, tokens: list[int], heads: int, steps: int, lr: float = 1e-3, seed: int = 0,
          log=lambda msg: None) -> DraftHead:
    """Fit heads on the base model's hidden states. h_t already predicts token t+1 (the
    model's own next token), so head i predicts tokens[t + 2 + i], the ones after it."""
    torch.manual_seed(seed)
    chunk = min(256, engine.cfg.ctx)
    hs = collect(engine, tokens, chunk)                                          # [N, E]
    ids = torch.tensor(tokens[:len(hs)])
    e = hs.shape[1]
    w = [torch.zeros(e, e, requires_grad=True) for _ in range(heads)]
    b = [torch.zeros(e, requires_grad=True) for _ in range(heads)]
    head = DraftHead(w, b)
    lm_head = engine.model.lm_head.float().cpu()
    opt = torch.optim.Adam(w + b, lr=lr)
    for step in range(steps):
        rows = torch.randint(0, len(hs) - heads - 2, (256,))
        loss = sum(F.cross_entropy(F.linear(head.hidden(hs[rows], i), lm_head), ids[rows + 2 + i])
                   for i in range(heads)) / heads
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"step {step}: loss {loss.item():.3f}")
    return DraftHead([x.detach() for x in w], [x.detach() for x in b])


def save(pack_path: Path, head: DraftHead, meta: dict) -> None:
    """Write draft.bin and the header's draft section (atomically)."""
    pack_path = Path(pack_path)
    flat = torch.cat([torch.cat([w.flatten(), b]) for w, b in zip(head.weights, head.biases)]).float()
    tmp = pack_path / (DRAFT_FILE + ".tmp")
    tmp.write_bytes(flat.numpy().tobytes())
    tmp.replace(pack_path / DRAFT_FILE)
    header = json.loads((pack_path / HEADER).read_text())
    header["draft"] = {"kind": "medusa", "heads": head.heads, "file": DRAFT_FILE,
                       "params": draft_params(head.weights[0].shape[0], head.heads), **meta}
    write_json_atomic(pack_path / HEADER, header)
