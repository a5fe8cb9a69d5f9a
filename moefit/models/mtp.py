"""Multi-token prediction (MTP) layers, the checkpoint's own draft source (DeepSeek-V3, section
2.2; Qwen3-Next / 3.5 / 3.6 and GLM-4.5 ship the same design). An MTP layer reads the hidden state
h_i the model produced at position i and the embedding of the token at i + 1, and predicts the
token at i + 2:

    x      = W_proj [RMSNorm_e(embed(t_{i+1})); RMSNorm_h(h_i)]
    x      = x + attention(norm(x))      over the MTP layer's own KV, at position i
    x      = x + moe(norm(x))            the family's MoE, its experts on the host
    logits = lm_head(RMSNorm_out(x))     the model's embedding and lm_head

Applied again to its own output, it drafts further tokens. The family builds the weights
(models/<family>.py: mtp_layer) and its attention and MoE run them; families/<family>.py says
which spelling its checkpoint uses (MTP):

    nextn   DeepSeek-V3, GLM-4.5: enorm, hnorm, eh_proj, shared_head.norm on layer L + j; the
            embedding at position 0 is zeroed and x before the output norm is the hidden passed
            on (as vLLM's reference implementation does)
    qwen    mtp.pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm (zero-centred); the normed
            hidden is passed on

Legend: T tokens, E hidden size.
"""

from __future__ import annotations

import torch

from moefit.models.attention import causal_mask
from moefit.models.layers import linear, rms_norm


def mtp_forward(model, mtp: dict, h: torch.Tensor, next_tokens: torch.Tensor, start: int, state,
                experts) -> torch.Tensor:
    """The MTP layer over positions start..start+T: h [T, E] the hidden states there, next_tokens [T]
    the tokens after each. Writes its KV (state's layer 0) and returns the hidden [T, E] it passes
    on; `logits(mtp, hidden)` turns rows of it into logits."""
    cfg, layer = model.cfg, mtp["layer"]
    eps = cfg.rms_norm_eps
    e = model.embed[next_tokens].to(device=h.device, dtype=h.dtype)                 # [T, E]
    if mtp["style"] == "nextn" and start == 0:
        e = torch.cat((torch.zeros_like(e[:1]), e[1:]))
    x = linear(torch.cat((rms_norm(e, mtp["embed_norm"], eps), rms_norm(h, mtp["hidden_norm"], eps)), dim=-1),
               mtp["project"])
    cos, sin = model.rope.rows(start, x.shape[0])
    mask = causal_mask(start, x.shape[0], cfg.sliding_window, x.device)
    x = x + model.attention(0, layer, rms_norm(x, layer["input_norm"], eps), start, cos, sin, mask, state)
    x = x + model.mlp(mtp["index"], layer, rms_norm(x, layer["post_norm"], eps), experts)
    return rms_norm(x, mtp["out_norm"], eps) if mtp["style"] == "qwen" else x


def mtp_logits(model, mtp: dict, hidden: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] (fp32) of the hidden rows mtp_forward passed on."""
    if mtp["style"] == "nextn":
        hidden = rms_norm(hidden, mtp["out_norm"], model.cfg.rms_norm_eps)
    return model.logits(hidden)
