"""A compact Llama forward over the target's own weights, reading and writing a `StaticKVCache`.

Why not `target.model(...)` with its cache: HF builds masks and cache objects every call and cannot
attend to a tree; this file is the whole decode/verify path (~100 lines), shares the target's parameter
tensors (no copy) and returns what `Target.forward` returns (logits, aux_hidden at target.layer_ids,
final_hidden), so feature-based sources (P-EAGLE, DSpark) work unchanged in the runtime.
Reproduces `target.model` logits in float32 (tests/test_runtime.py::test_llama_matches_hf).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from inference.kv_cache import StaticKVCache
from models.target import Target, TargetOutput


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaForward:
    def __init__(self, target: Target):
        self.target = target
        hf = target.model.model
        cfg = target.model.config
        self.layers = hf.layers
        self.norm = hf.norm
        self.rotary = hf.rotary_emb  # the target's own RoPE (theta, scaling type) -> exact cos/sin
        self.embed_tokens = hf.embed_tokens
        self.lm_head_module = target.model.get_output_embeddings()
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_layers = cfg.num_hidden_layers
        self.layer_ids = target.layer_ids

    def new_cache(self, batch_size: int, max_len: int, static: bool = False) -> StaticKVCache:
        return StaticKVCache(self.num_layers, batch_size, self.kv_heads, self.head_dim, max_len,
                             dtype=self.target.dtype, device=self.target.device, static=static)

    def _attention(self, layer: int, attn, x: Tensor, cos: Tensor, sin: Tensor, cache: StaticKVCache,
                   rows: Tensor, slots: Tensor, span: int, mask: Tensor) -> Tensor:
        B, T, _ = x.shape
        q = attn.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, nh, T, hd]
        k = attn.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, kvh, T, hd]
        v = attn.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, hd]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        keys, values = cache.write(layer, k, v, rows, slots, span)  # [B, kvh, S, hd]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self.kv_heads != self.num_heads)
        return attn.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,  # [B, T] new tokens (anchor + drafts, or a prompt)
        cache: StaticKVCache,
        tree_mask: Tensor | None = None,  # [B, T, T] bool, query j may see new token i; None = causal
        position_offsets: Tensor | None = None,  # [B, T] position - lengths[b]; None = 0..T-1 (chain)
        compute_logits: bool = True,
        rows: Tensor | None = None,  # [B] cache rows (requests) of this forward; None = all rows
        logits_at: Tensor | None = None,  # [B, T'] only these positions get logits (skips pads in a prefill)
    ) -> TargetOutput:
        B, T = input_ids.shape
        rows = cache.all_rows() if rows is None else rows
        slots = cache.slots(rows, T)  # [B, T], also checks max_len
        span = cache.span(slots)
        if tree_mask is None:
            tree_mask = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril().expand(B, T, T)
        positions = slots if position_offsets is None else cache.lengths[rows][:, None] + position_offsets
        mask = cache.attention_mask(rows, slots, tree_mask, span)  # [B, 1, T, S]
        h = self.embed_tokens(input_ids)  # [B, T, H]
        cos, sin = self.rotary(h, positions)  # [B, T, hd]
        captured = {}
        for i, layer in enumerate(self.layers):
            if i in self.layer_ids:
                captured[i] = h
            h = h + self._attention(i, layer.self_attn, layer.input_layernorm(h), cos, sin, cache, rows, slots, span, mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        captured[self.num_layers] = h  # last layer output, pre-norm (layer id L)
        final = self.norm(h)  # [B, T, H]
        aux = torch.cat([captured[i] for i in self.layer_ids], dim=-1)  # [B, T, n*H]
        logits = None
        if compute_logits:
            picked = final if logits_at is None else torch.gather(
                final, 1, logits_at[..., None].expand(-1, -1, final.shape[-1]))
            logits = self.lm_head_module(picked)  # [B, T or T', V]
        return TargetOutput(logits, aux, final, None)

    __call__ = forward
