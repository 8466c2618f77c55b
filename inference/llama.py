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
from models.layers import rms_norm, rotate_half
from models.errors import DraftheadsError
from models.target import Target, TargetOutput


SMALL_M_ROWS = 4  # inputs of 2..4 rows (verifying up to 3 drafts): see `linear`


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, except for 2..SMALL_M_ROWS rows on CPU: weight @ x^T, a different GEMM shape that this CPU build
    runs faster for a few rows. SmolLM2 forward over a 300-token cache, 2 idle cores, F.linear -> weight @ x^T:
    2 rows 73 -> 52 ms, 3 rows 89 -> 59 ms; 5-6 rows equal (66, 69 ms); 9 rows 75 -> 83 ms (worse, hence the
    cap); 1 row 38 ms either way."""
    rows = x.numel() // x.shape[-1]
    if x.device.type != "cpu" or not 2 <= rows <= SMALL_M_ROWS:
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.reshape(rows, -1).T).T.reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


class LlamaForward:
    def __init__(self, target: Target):
        self.target = target
        hf = target.model.model
        cfg = target.model.config
        if getattr(cfg, "hidden_act", "silu") != "silu" or cfg.model_type not in ("llama", "qwen2"):
            raise DraftheadsError(f"the runtime's compact forward covers Llama-style models (silu MLP); target "
                                  f"'{target.name}' is '{cfg.model_type}' with {cfg.hidden_act}; "
                                  "use inference.generate for it")
        # plain references to the target's parameters (no copy); module calls cost ~10 us each on CPU
        def wb(m):
            return m.weight, m.bias

        self.layers = [  # per layer: ln1, q, k, v, o, ln2, gate, up, down
            (layer.input_layernorm.weight, wb(layer.self_attn.q_proj), wb(layer.self_attn.k_proj),
             wb(layer.self_attn.v_proj), wb(layer.self_attn.o_proj), layer.post_attention_layernorm.weight,
             wb(layer.mlp.gate_proj), wb(layer.mlp.up_proj), wb(layer.mlp.down_proj))
            for layer in hf.layers
        ]
        self.eps = cfg.rms_norm_eps
        self.norm_weight = hf.norm.weight
        self.rotary = hf.rotary_emb  # the target's own RoPE (theta, scaling type) -> exact cos/sin
        self.embed_weight = hf.embed_tokens.weight
        self.lm_head_module = target.model.get_output_embeddings()
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_layers = cfg.num_hidden_layers
        self.layer_ids = target.layer_ids

    def new_cache(self, batch_size: int, max_len: int, static: bool = False) -> StaticKVCache:
        return StaticKVCache(self.num_layers, batch_size, self.kv_heads, self.head_dim, max_len,
                             dtype=self.target.dtype, device=self.target.device, static=static)

    def _attention(self, layer: int, x: Tensor, cos: Tensor, sin: Tensor, cache: StaticKVCache,
                   rows: Tensor, slots: Tensor, span: int, mask: Tensor) -> Tensor:
        _, q_proj, k_proj, v_proj, o_proj = self.layers[layer][:5]
        B, T, _ = x.shape
        q = linear(x, *q_proj).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, nh, T, hd]
        k = linear(x, *k_proj).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, kvh, T, hd]
        v = linear(x, *v_proj).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin  # cos, sin [B, 1, T, hd]
        k = k * cos + rotate_half(k) * sin
        keys, values = cache.write(layer, k, v, rows, slots, span)  # [B, kvh, S, hd]
        gqa = self.kv_heads != self.num_heads
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=gqa)  # [B, nh, T, hd]
        return linear(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim), *o_proj)

    def _mlp(self, layer: int, x: Tensor) -> Tensor:
        gate, up, down = self.layers[layer][6:]
        return linear(F.silu(linear(x, *gate)) * linear(x, *up), *down)

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
        tree_mask_given = tree_mask is not None
        if tree_mask is None:
            tree_mask = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril().expand(B, T, T)
        positions = slots if position_offsets is None else cache.lengths[rows][:, None] + position_offsets
        # an empty cache and a chain: plain causal attention (SDPA's fused causal kernel, ~5% faster prefill)
        causal = tree_mask_given is False and span == T
        mask = None if causal else cache.attention_mask(rows, slots, tree_mask, span)  # [B, 1, T, S]
        h = F.embedding(input_ids, self.embed_weight)  # [B, T, H]
        cos, sin = self.rotary(h, positions)  # [B, T, hd]
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, hd], broadcast over heads
        captured = {}
        for i, weights in enumerate(self.layers):
            if i in self.layer_ids:
                captured[i] = h
            h = h + self._attention(i, rms_norm(h, weights[0], self.eps), cos, sin, cache, rows, slots, span, mask)
            h = h + self._mlp(i, rms_norm(h, weights[5], self.eps))
        captured[self.num_layers] = h  # last layer output, pre-norm (layer id L)
        final = rms_norm(h, self.norm_weight, self.eps)  # [B, T, H]
        aux = torch.cat([captured[i] for i in self.layer_ids], dim=-1)  # [B, T, n*H]
        logits = None
        if compute_logits:
            picked = final if logits_at is None else torch.gather(
                final, 1, logits_at[..., None].expand(-1, -1, final.shape[-1]))
            lm = self.lm_head_module
            logits = linear(picked, lm.weight, lm.bias)  # [B, T or T', V]
        return TargetOutput(logits, aux, final, None)

    __call__ = forward
