"""P-EAGLE: an EAGLE-3 draft head that drafts K tokens in ONE forward (parallel), or the classic chain.

Layout mirrors vLLM's speculators EAGLE-3 draft so export is a rename:
  fc [H, 3H] (no bias) fuses the aux hidden states of 3 target layers;
  layers.0 is a Llama decoder layer whose q/k/v read [input_layernorm(embed); hidden_norm(hidden)] (2H);
  layers.1.. are plain Llama layers; norm; lm_head (the target's frozen one, or a draft-vocab head of N rows
  with d2t / t2d maps).
A head trained elsewhere (speculators 0.9 writes Qwen3-style layers) may carry three more pieces, each off by
default and recorded in `config`: qk_norm (per-head RMSNorm of q and k before RoPE, layers.i.self_attn.q_norm /
k_norm [head_dim]), own_embedding (its trained embed_tokens [V, H] instead of the target's; P-EAGLE's mask slot then
embeds mask_token_id, as vLLM does) and own_lm_head (its trained full-vocabulary lm_head [V, H]). Fine-tuning trains
them like any other parameter.

Alignment (the one place an off-by-one can hide). Features row t = target hidden states after reading tokens
x_0..x_t. The draft token with anchor t and depth d (d = 1..K) sits at position t + d - 1 and predicts x_{t+d+1};
its label distribution is the target's logits at row t + d. Inputs:
  depth 1:                   [embed(x_{t+1}); fc(aux_t)]                     (everything here is committed)
  depth d > 1, parallel:     [mask_embedding; fc(mask_hidden)]                (shared learnable slot)
  depth d > 1, chain:        [embed(x_{t+d}) (drafted at inference); prenorm output of depth d-1, no fc]
Attention: a depth-d token of anchor t sees depth-1 tokens of anchors <= t and the depth 2..d tokens of its own
anchor. The same rule serves training (all anchors at once, COD-sampled deeper depths), the chain's
training-time test and inference with a cache of depth-1 keys/values.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.draft_vocab import DraftVocab
from models.errors import DraftheadsError
from models.layers import TrainableHead, rms_norm, rotate_half


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_type(rope_scaling: dict | None) -> str:
    """'default', 'llama3', 'yarn', ... of a config's rope_scaling entry (old configs spell the key 'type')."""
    return (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))


# transformers recomputes these from the current sequence length in its forward: a fixed table cannot match them
SEQUENCE_DEPENDENT_ROPE = ("dynamic", "longrope")


def scaled_rope(head_dim: int, theta: float, rope_scaling: dict) -> tuple[Tensor, float]:
    """(inv_freq [head_dim/2] float32 on the CPU, cos/sin factor) of a scaled RoPE, from transformers' own init
    function for its type, so a head rotates exactly as its target (Llama 3.1+: 'llama3', factor 8)."""
    return _scaled_rope(head_dim, float(theta), json.dumps(rope_scaling, sort_keys=True))


@functools.lru_cache(maxsize=16)
def _scaled_rope(head_dim: int, theta: float, rope_scaling_json: str) -> tuple[Tensor, float]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_scaling = json.loads(rope_scaling_json)
    kind = rope_type(rope_scaling)
    if kind not in ROPE_INIT_FUNCTIONS or kind in SEQUENCE_DEPENDENT_ROPE:
        static = sorted(set(ROPE_INIT_FUNCTIONS) - set(SEQUENCE_DEPENDENT_ROPE))
        raise DraftheadsError(f"rope_scaling {rope_scaling} has rope_type '{kind}', which a draft head cannot "
                              f"reproduce; heads support 'default' and {static}")
    # the context the scaling stretches to (transformers only checks it; the dict carries the pretraining length)
    original = rope_scaling.get("original_max_position_embeddings")
    max_pos = 2048 if original is None else int(original * float(rope_scaling.get("factor") or 1.0))
    config = LlamaConfig(hidden_size=head_dim, num_attention_heads=1, num_key_value_heads=1, head_dim=head_dim,
                         rope_theta=theta, rope_scaling=dict(rope_scaling), max_position_embeddings=max_pos)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, None)
    return inv_freq.float(), float(attention_factor)


def rotary(positions: Tensor, head_dim: int, theta: float, rope_scaling: dict | None = None) -> tuple[Tensor, Tensor]:
    """cos, sin [B, 1, N, head_dim] for integer positions [B, N]: Llama's 'default' RoPE, or the target's scaled one
    when rope_scaling names another type (see scaled_rope)."""
    if rope_type(rope_scaling) == "default":
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
        factor = 1.0
    else:
        inv_freq, factor = scaled_rope(head_dim, theta, rope_scaling)
        inv_freq = inv_freq.to(positions.device)
    angles = positions.float()[..., None] * inv_freq  # [B, N, hd/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    if factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * factor, angles.sin() * factor  # yarn's attention factor, as transformers applies it


def head_rope_scaling(rope_scaling: dict | None, head_dim: int, theta: float) -> dict | None:
    """The rope_scaling a head records: None for the default RoPE, else a copy (checked: an unsupported type fails
    when the head is built, not at the first forward)."""
    if rope_type(rope_scaling) == "default":
        return None
    scaled_rope(head_dim, theta, rope_scaling)
    return dict(rope_scaling)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, in_size: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 qk_norm: bool = False, eps: float = 1e-5):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(in_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(in_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        if qk_norm:  # Qwen3: each head's q and k are RMS-normed over head_dim before RoPE
            self.q_norm, self.k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past: tuple[Tensor, Tensor] | None):
        B, N, _ = x.shape
        q = self.q_proj(x).view(B, N, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, N, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        new_kv = (k, v)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        rep = self.num_heads // self.num_kv_heads
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, N, self.num_heads * self.head_dim)), new_kv


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Llama decoder layer; the first one (EAGLE-3) also reads the token embedding: q/k/v take 2H inputs."""

    def __init__(self, first: bool, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, eps,
                 norm_before_residual: bool, qk_norm: bool = False):
        super().__init__()
        self.first, self.norm_before_residual = first, norm_before_residual
        self.input_layernorm = RMSNorm(hidden_size, eps)
        if first:
            self.hidden_norm = RMSNorm(hidden_size, eps)
        in_size = 2 * hidden_size if first else hidden_size
        self.self_attn = Attention(in_size, hidden_size, num_heads, num_kv_heads, head_dim, qk_norm, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = MLP(hidden_size, intermediate_size)

    def forward(self, embeds, hidden, cos, sin, mask, past):
        if self.first:
            normed_hidden = self.hidden_norm(hidden)
            residual = normed_hidden if self.norm_before_residual else hidden
            x = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)
        else:
            residual, x = hidden, self.input_layernorm(hidden)
        attn, new_kv = self.self_attn(x, cos, sin, mask, past)
        h = residual + attn
        return h + self.mlp(self.post_attention_layernorm(h)), new_kv


def draft_attention_mask(q_anchor, q_depth, k_anchor, k_depth, k_valid) -> Tensor:
    """[B, 1, Nq, Nk] bool (True = attend): depth-1 keys of anchors <= the query's, plus same-anchor depths <= its own."""
    qa, qd = q_anchor[:, :, None], q_depth[:, :, None]
    ka, kd = k_anchor[:, None, :], k_depth[:, None, :]
    allowed = ((kd == 1) & (ka <= qa)) | ((ka == qa) & (kd <= qd))
    allowed = allowed & k_valid[:, None, :]
    # a padded query must see something or SDPA returns NaN: let every query see at least key 0 (its output is dropped)
    allowed[..., 0] |= ~allowed.any(-1)
    return allowed[:, None]


@dataclass
class DraftTrainOutput:
    """What the trainer needs from any drafter: per-row hidden states and where each row's label lives."""

    hidden: Tensor  # [N, H]; drafter.logits_for(hidden, depth) -> [N, V_draft]
    batch_index: Tensor  # [N] sequence in the batch
    anchor: Tensor  # [N] anchor t: the label is the target's distribution at row t + depth (token t + depth + 1)
    depth: Tensor  # [N] 1..K


class PEagleDrafter(TrainableHead):
    family = "peagle"
    feature = "aux_hidden"  # which DraftContext features draft_logits reads

    def __init__(self, hidden_size: int, num_aux_layers: int, num_layers: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, intermediate_size: int, vocab_size: int, k: int, parallel: bool = True,
                 draft_vocab_size: int | None = None, rms_norm_eps: float = 1e-5, rope_theta: float = 10000.0,
                 norm_before_residual: bool = False, rope_scaling: dict | None = None, qk_norm: bool = False,
                 own_embedding: bool = False, own_lm_head: bool = False, mask_token_id: int | None = None):
        super().__init__()
        rope_scaling = head_rope_scaling(rope_scaling, head_dim, rope_theta)
        draft_vocab = draft_vocab_size is not None and draft_vocab_size < vocab_size
        if own_lm_head and draft_vocab:
            raise DraftheadsError(f"own_lm_head is for full-vocabulary heads; a head with draft_vocab_size="
                                  f"{draft_vocab_size} < {vocab_size} always has its own LM head of those rows")
        if own_embedding and parallel and (mask_token_id is None or not 0 <= mask_token_id < vocab_size):
            raise DraftheadsError(f"a P-EAGLE head with its own embedding embeds mask_token_id for depths 2..K; "
                                  f"mask_token_id={mask_token_id} is not a token id in 0..{vocab_size - 1}")
        self.config = dict(hidden_size=hidden_size, num_aux_layers=num_aux_layers, num_layers=num_layers,
                           num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           intermediate_size=intermediate_size, vocab_size=vocab_size, k=k, parallel=parallel,
                           draft_vocab_size=draft_vocab_size, rms_norm_eps=rms_norm_eps, rope_theta=rope_theta,
                           norm_before_residual=norm_before_residual, rope_scaling=rope_scaling, qk_norm=qk_norm,
                           own_embedding=own_embedding, own_lm_head=own_lm_head,
                           mask_token_id=mask_token_id if own_embedding and parallel else None)
        self.k, self.parallel, self.head_dim, self.rope_theta = k, parallel, head_dim, rope_theta
        self.rope_scaling = rope_scaling
        self.vocab_size = vocab_size
        self.mask_token_id = self.config["mask_token_id"]
        H = hidden_size
        self.fc = nn.Linear(num_aux_layers * H, H, bias=False)
        self.layers = nn.ModuleList(
            DecoderLayer(i == 0, H, num_heads, num_kv_heads, head_dim, intermediate_size, rms_norm_eps,
                         norm_before_residual, qk_norm)
            for i in range(num_layers)
        )
        self.norm = RMSNorm(H, rms_norm_eps)
        if parallel:  # the shared slot for depths 2..K (mask_hidden is 3H, before fc, as vLLM expects)
            if not own_embedding:  # with its own embedding the slot embeds mask_token_id instead
                self.mask_embedding = nn.Parameter(torch.randn(H) * 0.02)
            self.mask_hidden = nn.Parameter(torch.randn(num_aux_layers * H) * 0.02)
        if own_embedding:
            self.embed_tokens = nn.Embedding(vocab_size, H)
        if draft_vocab:
            self.lm_head = nn.Linear(H, draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))
        elif own_lm_head:
            self.lm_head = nn.Linear(H, vocab_size, bias=False)
        self._shared: dict[str, nn.Module] = {}  # frozen target modules: NOT parameters of the head, not saved

    @property
    def family_name(self) -> str:
        return "peagle" if self.parallel else "eagle3"

    # -- wiring --------------------------------------------------------------------------------
    def attach_target(self, target, draft_vocab: DraftVocab | None = None, fresh: bool = False) -> "PEagleDrafter":
        """Share the target's frozen embedding and full-vocabulary LM head (unless the head has its own); init a fresh
        draft-vocab head."""
        if not hasattr(self, "embed_tokens"):
            self._shared["embed"] = target.model.get_input_embeddings()
        if hasattr(self, "d2t"):
            if fresh and draft_vocab is not None:  # fresh head: maps + rows of the target LM head as a warm start
                self.d2t.copy_(draft_vocab.d2t)
                self.t2d.copy_(draft_vocab.t2d)
                with torch.no_grad():
                    self.lm_head.weight.copy_(target.model.get_output_embeddings().weight[draft_vocab.draft_ids])
        elif not hasattr(self, "lm_head"):
            self._shared["lm_head"] = target.model.get_output_embeddings()
        return self

    @property
    def draft_ids(self) -> Tensor | None:
        """[N] target ids of the draft vocabulary (None = full vocabulary)."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t if hasattr(self, "d2t") else None

    def embed(self, ids: Tensor) -> Tensor:
        """Token embeddings (its own, or the target's) in the head's dtype."""
        embeds = self.embed_tokens(ids) if hasattr(self, "embed_tokens") else self._shared["embed"](ids)
        return embeds.to(self.fc.weight.dtype)

    def logits(self, normed: Tensor) -> Tensor:
        """[..., V_draft] (V_draft = V for a full-vocabulary head, its own LM head or the target's)."""
        head = self.lm_head if hasattr(self, "lm_head") else self._shared["lm_head"]
        return head(normed.to(head.weight.dtype))  # the target's LM head may be in another dtype than the head

    def full_vocab_logits(self, logits: Tensor) -> Tensor:
        """Draft-vocab logits [..., N] -> target-vocab logits [..., V] (-inf outside the draft vocab)."""
        if not hasattr(self, "d2t"):
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy(-1, self.draft_ids, logits)

    # -- core ----------------------------------------------------------------------------------
    def run_layers(self, embeds, hidden, positions, mask, past=None):
        """embeds, hidden [B, N, H] -> prenorm output [B, N, H] and per-layer (k, v) of these N tokens."""
        cos, sin = rotary(positions, self.head_dim, self.rope_theta, self.rope_scaling)
        new_kv = []
        for i, layer in enumerate(self.layers):
            hidden, kv = layer(embeds, hidden, cos, sin, mask, None if past is None else past[i])
            new_kv.append(kv)
        return hidden, new_kv

    def slot_inputs(self, n: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """Parallel slots for depths 2..K: (mask embedding, fc(mask_hidden)), each [n, H]."""
        H = self.fc.out_features
        mask_embedding = self.embed_tokens.weight[self.mask_token_id] if hasattr(self, "embed_tokens") else \
            self.mask_embedding
        return mask_embedding.to(like.dtype).expand(n, H), self.fc(self.mask_hidden.to(like.dtype)).expand(n, H)

    # -- training ------------------------------------------------------------------------------
    def train_forward(self, batch: dict, plan) -> DraftTrainOutput:
        """All anchors of the batch at once. `plan` (train.cod.CodPlan) says which (anchor, depth) tokens exist.

        The chain's depth d reads token x_{anchor+d}; batch["slot_tokens"] [B, N] (optional) overrides the token
        each plan column reads, for blocks that are not the sequence's own continuation (RL's sampled drafts)."""
        ids, aux = batch["input_ids"], batch["aux_hidden"]  # [B, T], [B, T, nH]
        B, T = ids.shape
        d1 = plan.depth == 1  # [B, N]
        a = plan.anchor.clamp(min=0)
        next_ids = ids.gather(1, (a + 1).clamp(max=T - 1))  # token x_{t+1} for depth-1 slots
        embeds = self.embed(next_ids)
        hidden = self.fc(aux.gather(1, a[..., None].expand(-1, -1, aux.shape[-1])))
        positions = a + plan.depth - 1
        if self.parallel:
            m_embed, m_hidden = self.slot_inputs(1, hidden)
            embeds = torch.where(d1[..., None], embeds, m_embed)
            hidden = torch.where(d1[..., None], hidden, m_hidden)
            mask = draft_attention_mask(plan.anchor, plan.depth, plan.anchor, plan.depth, plan.valid)
            prenorm, _ = self.run_layers(embeds, hidden, positions, mask)
        else:  # training-time test: depth d reads depth d-1's output; tokens are the true ones (teacher forcing)
            prenorm = torch.zeros_like(hidden)
            past = None
            # every depth, even one a short plan lacks (no columns): the same module calls whatever the data (ZeRO-3)
            for d in range(1, self.k + 1):
                cols = plan.depth_columns(d)  # [n_d] columns of the plan holding depth d
                qa, qd = plan.anchor[:, cols], plan.depth[:, cols]
                fed = batch["slot_tokens"][:, cols] if "slot_tokens" in batch else \
                    ids.gather(1, (qa.clamp(min=0) + d).clamp(max=T - 1))
                e = self.embed(fed)
                pred = plan.predecessor[:, cols, None].clamp(min=0).expand(-1, -1, hidden.shape[-1])
                h = hidden[:, cols] if d == 1 else prenorm.gather(1, pred)
                seen = plan.columns_up_to(d)
                mask = draft_attention_mask(qa, qd, plan.anchor[:, seen], plan.depth[:, seen], plan.valid[:, seen])
                out, kv = self.run_layers(e, h, positions[:, cols], mask, past)
                prenorm = prenorm.index_copy(1, cols, out)
                past = kv if past is None else [(torch.cat([p[0], n[0]], 2), torch.cat([p[1], n[1]], 2)) for p, n in zip(past, kv)]
        keep = plan.valid & plan.trained  # rows with a label; logits are made later, in chunks ([N, V] is large)
        b_idx = torch.arange(B, device=ids.device)[:, None].expand(B, plan.anchor.shape[1])
        return DraftTrainOutput(self.norm(prenorm[keep]), b_idx[keep], plan.anchor[keep], plan.depth[keep])

    def logits_for(self, hidden: Tensor, depth: Tensor) -> Tensor:
        """hidden [N, H] from train_forward -> logits [N, V_draft]."""
        return self.logits(hidden)


    # -- inference -----------------------------------------------------------------------------
    @torch.no_grad()
    def draft_logits(self, tokens: Tensor, aux: Tensor, cache: "DraftCache", k: int, sample_fn) -> Tensor:
        """Logits [k, V_draft] for the k tokens after `tokens` [T]; aux [T-1, nH] are the target features of tokens[:-1].

        `cache` holds depth-1 keys/values of committed anchors. Parallel: one forward (new context anchors + k-1
        mask slots). Chain: k forwards, each feeding the sampled token (sample_fn(logits [V_draft]) -> id) back.
        """
        T = tokens.numel()
        n_ctx = T - 1
        start = cache.valid_prefix(tokens, n_ctx)
        anchors = torch.arange(start, n_ctx, device=tokens.device)
        embeds = self.embed(tokens[anchors + 1])
        hidden = self.fc(aux[anchors].to(self.fc.weight.dtype))
        depth = torch.ones_like(anchors)
        last = n_ctx - 1
        n_slots = k - 1 if self.parallel else 0
        if n_slots > 0:
            m_embed, m_hidden = self.slot_inputs(n_slots, hidden)
            embeds, hidden = torch.cat([embeds, m_embed]), torch.cat([hidden, m_hidden])
            anchors = torch.cat([anchors, anchors.new_full((n_slots,), last)])
            depth = torch.cat([depth, torch.arange(2, k + 1, device=tokens.device)])
        prenorm, kv = self._step(embeds, hidden, anchors, depth, cache)
        n_new = n_ctx - start
        cache.append(tokens, [(kk[:, :, :n_new], vv[:, :, :n_new]) for kk, vv in kv], n_ctx)
        if self.parallel:
            return self.logits(self.norm(prenorm[n_new - 1:]))  # depth 1 of the last anchor, then slots 2..k
        out = [self.logits(self.norm(prenorm[n_new - 1]))]
        h, extra = prenorm[n_new - 1:n_new], None
        for d in range(2, k + 1):
            tok = sample_fn(out[-1]).view(1)
            a, dd = torch.tensor([last], device=tokens.device), torch.tensor([d], device=tokens.device)
            h, kv = self._step(self.embed(tok), h, a, dd, cache, extra)
            extra = kv if extra is None else [(torch.cat([p[0], n[0]], 2), torch.cat([p[1], n[1]], 2)) for p, n in zip(extra, kv)]
            out.append(self.logits(self.norm(h[0])))
        return torch.stack(out)

    def _step(self, embeds, hidden, anchors, depth, cache, extra=None):
        """Run [N] new tokens against the cached depth-1 keys (+ extra chain keys); returns prenorm [N, H], new kv."""
        k_anchor, k_depth, past = cache.keys(extra, anchors.device)
        k_anchor = torch.cat([k_anchor, anchors])[None]
        k_depth = torch.cat([k_depth, depth])[None]
        mask = draft_attention_mask(anchors[None], depth[None], k_anchor, k_depth, torch.ones_like(k_anchor, dtype=torch.bool))
        prenorm, kv = self.run_layers(embeds[None], hidden[None], (anchors + depth - 1)[None], mask, past)
        return prenorm[0], kv


class DraftCache:
    """Depth-1 keys/values of committed anchors for one request; reused while the context only grows."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.tokens = None  # [n+1] tokens the cached anchors read
        self.kv = None  # per layer (k, v) [1, kvh, n, hd]
        self.n = 0

    def valid_prefix(self, tokens: Tensor, n_ctx: int) -> int:
        """Keep the cached anchors whose inputs (token a+1) are unchanged, and at least one new anchor."""
        if self.tokens is None:
            return 0
        m = min(self.n, n_ctx - 1, tokens.numel() - 1)
        same = (tokens[: m + 1] == self.tokens[: m + 1]).long().cumprod(0)
        m = max(0, int(same.sum()) - 1)  # anchor a stays valid while tokens[:a+2] match
        if m == 0:
            self.reset()
            return 0
        self.kv = [(k[:, :, :m], v[:, :, :m]) for k, v in self.kv]
        self.n = m
        return m

    def append(self, tokens: Tensor, new_kv, n_ctx: int):
        if self.kv is None:
            self.kv = new_kv
        else:
            self.kv = [(torch.cat([p[0], n[0]], 2), torch.cat([p[1], n[1]], 2)) for p, n in zip(self.kv, new_kv)]
        self.tokens, self.n = tokens[: n_ctx + 1].clone(), n_ctx

    def keys(self, extra, device):
        """(anchor [M], depth [M], per-layer past kv or None) for the cached context (+ chain extras)."""
        anchor = torch.arange(self.n, device=device)
        depth = torch.ones_like(anchor)
        past = self.kv
        if extra is not None:  # chain steps 2..d-1 of the last anchor
            m = extra[0][0].shape[2]
            anchor = torch.cat([anchor, anchor.new_full((m,), self.n - 1)])
            depth = torch.cat([depth, torch.arange(2, 2 + m, device=device)])
            past = [(torch.cat([p[0], e[0]], 2), torch.cat([p[1], e[1]], 2)) for p, e in zip(past, extra)]
        return anchor, depth, past


def peagle_for_target(target, k: int, num_layers: int = 1, parallel: bool = True,
                      draft_vocab: DraftVocab | None = None, norm_before_residual: bool = False) -> PEagleDrafter:
    """A fresh head sized from the target's config (heads, head dim, MLP width, RoPE theta and scaling)."""
    head = PEagleDrafter(**target_layer_sizes(target), num_layers=num_layers, k=k, parallel=parallel,
                         draft_vocab_size=None if draft_vocab is None else draft_vocab.size,
                         norm_before_residual=norm_before_residual)
    return head.to(target.dtype).attach_target(target, draft_vocab, fresh=True)


def target_layer_sizes(target) -> dict:
    """Constructor sizes a draft head copies from its target: hidden size, fused layers, heads, head dim, MLP
    width, vocab, norm eps, RoPE theta and scaling."""
    return dict(decoder_sizes(target.model.config), num_aux_layers=len(target.layer_ids), vocab_size=target.vocab_size)


def decoder_sizes(c) -> dict:
    """Decoder-layer sizes of a transformers config (a target's, or an exported head's transformer_layer_config):
    hidden size, heads, head dim, MLP width, norm eps, RoPE theta and scaling."""
    # transformers >= 5: rope_parameters holds theta, type and scaling; 4.x: rope_theta + rope_scaling (or None)
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    theta = rope.pop("rope_theta", getattr(c, "rope_theta", 10000.0))
    return dict(hidden_size=c.hidden_size, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps, rope_theta=float(theta),
                rope_scaling=None if rope_type(rope) == "default" else rope)
