"""The look-ahead's trained probe: for each MoE layer j, a matrix [N, E] that reads the residual
stream one layer earlier (after layer j-1's attention, through layer j's own norm, exactly what
the untrained guess reads) and gives layer j's router logits.

Without a probe the guess is layer j's own router applied to that earlier state (no training);
the probe is the least-squares map from the earlier state to the router logits layer j really
computes, pulled towards the router itself (ridge regression with the router as its prior), so
it starts from the untrained guess and moves only as far as the recorded tokens justify. The
fit keeps sums, not tokens: per layer the features' Gram matrix [E, E] and their cross product
with the targets [E, N] (fp32 on the host: L x E^2 x 4 bytes, about 790 MB for Qwen3-30B-A3B); every
fifth prompt (up to 4,096 tokens) is held out and scores the fit, its recall of the layer's top-k against the
router's; a layer keeps the probe only where it beats the router there.

`moefit profile PACK --prompts FILE --probe` fits it; it is stored in the pack as probe.bin
(fp32) with a "probe" header section (its layers and recalls); on a device that looks ahead it
is placed with the dense weights, in the dense line (Footprint.probe_bytes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from moefit.models.layers import rms_norm
from moefit.pack.format import HEADER, write_json_atomic

PROBE_FILE = "probe.bin"
ALPHAS = (1e-3, 1e-2, 1e-1, 1.0)     # ridge strength tried, as a share of the features' mean energy
HOLD_EVERY = 5                        # every fifth prompt scores the fit instead of fitting it
HELD_MAX = 4096                       # held-out tokens kept per layer


@dataclass
class Probe:
    matrices: dict[int, torch.Tensor]            # layer -> [N, E] fp32, where the probe beat the router
    router_recall: dict[int, float]              # layer -> held-out recall of the router's guess
    probe_recall: dict[int, float]               # layer -> held-out recall of the fitted map (best ridge)
    tokens: int                                  # tokens fitted (held-out ones not included)
    held_out: int


class ProbeFit:
    """Collects (earlier state, router logits) pairs as the model runs: decoder_stack calls
    see(model, i, x, h) before each layer's MLP (x the residual, h its normed MLP input)."""

    def __init__(self, top_k: int):
        self.top_k = top_k
        self.gram: dict[int, torch.Tensor] = {}
        self.cross: dict[int, torch.Tensor] = {}
        self.held: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.holding = False                             # the prompt running now is held out
        self.fitted: dict[int, int] = {}                 # layer -> tokens in the sums
        self.pending: dict[int, torch.Tensor] = {}       # layer j -> features read one layer earlier

    def see(self, model, i: int, x: torch.Tensor, h: torch.Tensor) -> None:
        layers, eps = model.layers, model.cfg.rms_norm_eps
        if i in self.pending:
            self._add(i, self.pending.pop(i), F.linear(h.float(), layers[i]["router"].float()))
        if i + 1 < len(layers) and "router" in layers[i + 1]:
            self.pending[i + 1] = rms_norm(x, layers[i + 1]["post_norm"], eps).float()      # what the guess reads

    def begin(self, prompt: int) -> None:
        """The tokens that follow belong to prompt number `prompt`: every fifth prompt is held out."""
        self.holding = prompt % HOLD_EVERY == HOLD_EVERY - 1

    def _add(self, j: int, feat: torch.Tensor, tgt: torch.Tensor) -> None:
        feat, tgt = feat.cpu(), tgt.cpu()
        kept = self.held.setdefault(j, [])
        if self.holding and sum(len(f) for f, _ in kept) < HELD_MAX:
            kept.append((feat, tgt))
            return
        self.fitted[j] = self.fitted.get(j, 0) + len(feat)
        if j not in self.gram:
            self.gram[j] = torch.zeros(feat.shape[1], feat.shape[1])
            self.cross[j] = torch.zeros(feat.shape[1], tgt.shape[1])
        self.gram[j] += feat.T @ feat
        self.cross[j] += feat.T @ tgt

    def fit(self, model) -> Probe:
        """The best ridge per layer by held-out recall; layers without held-out tokens (fewer
        than five prompts) or where the router does as well keep the router."""
        matrices, router, probe = {}, {}, {}
        tokens = held_out = 0
        for j in sorted(self.gram):
            feat, tgt = (torch.cat(t) for t in zip(*self.held[j])) if self.held.get(j) else (None, None)
            if feat is None:
                continue
            prior = model.layers[j]["router"].float().cpu()                       # [N, E]
            router[j] = recall(feat @ prior.T, tgt, self.top_k)
            best = max((self._solve(j, prior, a) for a in ALPHAS), key=lambda m: recall(feat @ m.T, tgt, self.top_k))
            probe[j] = recall(feat @ best.T, tgt, self.top_k)
            if probe[j] > router[j]:
                matrices[j] = best
            tokens, held_out = max(tokens, self.fitted[j]), max(held_out, len(feat))
        return Probe(matrices, router, probe, tokens, held_out)

    def _solve(self, j: int, prior: torch.Tensor, alpha: float) -> torch.Tensor:
        """argmin |F P^T - T|^2 + lam |P - R|^2, lam = alpha x the features' mean energy."""
        g = self.gram[j].double()
        lam = alpha * float(g.diagonal().mean()) or alpha
        rhs = self.cross[j].double() + lam * prior.T.double()
        return torch.linalg.solve(g + lam * torch.eye(len(g), dtype=g.dtype), rhs).T.float().contiguous()


def recall(logits: torch.Tensor, target: torch.Tensor, k: int) -> float:
    """Share of the target's top-k that the logits' top-k names."""
    guess, truth = logits.topk(k, dim=-1).indices, target.topk(k, dim=-1).indices
    hits = (guess.unsqueeze(-1) == truth.unsqueeze(-2)).any(-1).sum()
    return float(hits / truth.numel()) if truth.numel() else 0.0


def save(pack_path: Path, probe: Probe, prompts: int) -> None:
    """Write probe.bin and the header's probe section (atomically); a fit that beat the router
    nowhere removes any earlier probe."""
    pack_path = Path(pack_path)
    header = json.loads((pack_path / HEADER).read_text())
    layers = sorted(probe.matrices)
    if layers:
        flat = torch.cat([probe.matrices[j].flatten() for j in layers])
        tmp = pack_path / (PROBE_FILE + ".tmp")
        tmp.write_bytes(flat.numpy().tobytes())
        tmp.replace(pack_path / PROBE_FILE)
        n, e = probe.matrices[layers[0]].shape
        header["probe"] = {"file": PROBE_FILE, "layers": layers, "shape": [n, e], "params": len(layers) * n * e,
                           "prompts": prompts, "tokens": probe.tokens, "held_out": probe.held_out,
                           "router_recall": _keyed(probe.router_recall), "probe_recall": _keyed(probe.probe_recall)}
    else:
        header.pop("probe", None)
        (pack_path / PROBE_FILE).unlink(missing_ok=True)
    write_json_atomic(pack_path / HEADER, header)


def install(pack_path: Path, matrices: Path, section: dict) -> None:
    """Put a probe fitted elsewhere (the demo's shipped one) into a pack of the same model."""
    pack_path = Path(pack_path)
    (pack_path / PROBE_FILE).write_bytes(Path(matrices).read_bytes())
    header = json.loads((pack_path / HEADER).read_text())
    header["probe"] = {**section, "file": PROBE_FILE}
    write_json_atomic(pack_path / HEADER, header)


def _keyed(per_layer: dict[int, float]) -> dict[str, float]:
    return {str(j): round(v, 4) for j, v in per_layer.items()}


def load(pack, place) -> dict[int, torch.Tensor]:
    """The pack's probe matrices, each placed by `place` (the dense line, compute dtype)."""
    info = pack.header.get("probe")
    if not info:
        return {}
    n, e = info["shape"]
    raw = torch.from_file(str(pack.path / info["file"]), size=info["params"], dtype=torch.float32)
    return {j: place(raw[i * n * e:(i + 1) * n * e].view(n, e)) for i, j in enumerate(info["layers"])}
