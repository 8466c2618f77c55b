"""A compact Llama forward over the target's own weights, reading and writing a `StaticKVCache`.

Why not `target.model(...)` with its cache: HF builds masks and cache objects every call and cannot
attend to a tree; this file is the whole decode/verify path (~100 lines), reads the target's parameters
(CPU weights packed once for oneDNN, see `pack_for_cpu`; otherwise the tensors themselves) and
returns what `Target.forward` returns (logits, aux_hidden at target.layer_ids, final_hidden),
so feature-based sources (P-EAGLE, DSpark) work unchanged in the runtime.
Reproduces `target.model` logits in float32 (tests/test_runtime.py::test_llama_matches_hf).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from inference import cpu_kernels
from inference.cpu_kernels import CompiledAttention
from inference.kv_cache import StaticKVCache
from models.layers import rms_norm, rotate_half
from models.errors import DraftheadsError
from models.target import Target, TargetOutput


def packs_for_cpu(weight: Tensor) -> bool:
    """Whether `pack_for_cpu` packs this weight: bfloat16 for the compiled kernel or wherever oneDNN runs it, float32
    on CPUs other than Intel's (see `pack_for_cpu`)."""
    if cpu_kernels.serves_bf16_linear(weight):
        return True
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return not cpu_kernels.intel_cpu()
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_for_cpu(weight: Tensor) -> Tensor:
    """The weight in oneDNN's blocked layout, packed once, or the weight itself where that does not apply.

    float32: torch's F.linear runs MKL, which takes its AVX2 path on AMD CPUs and repacks the weight on every call there;
    oneDNN's inner product on a pre-packed weight uses AVX-512 and packs nothing: 30 -> 22 ms per SmolLM2 forward of
    1 row (`python -m eval.linear_bench`). On an Intel Xeon (AMX) MKL's F.linear was the faster one (1 row 32 ms
    against 49 packed, 9 rows equal), so float32 stays unpacked on Intel CPUs.
    bfloat16 F.linear goes through oneDNN but reorders the plain weight into its blocked layout on every call; a
    weight reordered once made the 211 linears of a SmolLM2 decode step 1.2-1.35x faster (AMX Xeon, 2 rows) and
    gives bitwise F.linear's output for 1-64+ rows and every SmolLM2 shape (tests/test_runtime.py). Costs one extra
    copy of the weights in memory. Where the CPU has no bfloat16 instructions, a bfloat16 weight becomes a
    `cpu_kernels.Bf16Weight`, multiplied by the compiled kernel (no copy)."""
    if cpu_kernels.serves_bf16_linear(weight):
        return cpu_kernels.Bf16Weight(weight)
    if not packs_for_cpu(weight):
        return weight
    if weight.dtype == torch.float32:
        return weight.detach().to_mkldnn()
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 2)  # 2: the rows of a decode step


class Projections:
    """Linears that read the same input (q/k/v; gate/up) as one GEMM over their concatenated weights where the weights
    are packed for the CPU (the packed copy costs the memory either way): 5 GEMM calls per layer become 2, which made
    a SmolLM2 bf16 decode step's projections 15-25% faster, with outputs bitwise those of the separate GEMMs
    (tests/test_runtime.py). Elsewhere (a GPU, where a concatenated copy would double a large target's memory; an
    unpacked run for torch.compile) one GEMM each."""

    def __init__(self, modules: list, pack: bool):
        weights, biases = [m.weight for m in modules], [m.bias for m in modules]
        self.sizes = None
        if pack and packs_for_cpu(weights[0]):
            self.sizes = [w.shape[0] for w in weights]
            bias = None if all(b is None for b in biases) else torch.cat(
                [w.new_zeros(w.shape[0]) if b is None else b.detach() for w, b in zip(weights, biases)])
            self.parts = [(pack_for_cpu(torch.cat([w.detach() for w in weights])), bias)]
        else:
            self.parts = [(pack_for_cpu(w) if pack else w, b) for w, b in zip(weights, biases)]

    def __call__(self, x: Tensor, linear_fn) -> list[Tensor]:
        if self.sizes is not None:
            return list(linear_fn(x, *self.parts[0]).split(self.sizes, -1))
        return [linear_fn(x, w, b) for w, b in self.parts]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, row_block: int | None = None) -> Tensor:
    """F.linear on a dense weight, oneDNN's inner product on one packed by `pack_for_cpu`.

    On CPU a 1-row input takes a GEMV kernel whose sums round differently from the GEMM that 2+ rows take. In
    bfloat16 that difference flips greedy tokens, so a 1-row bfloat16 input goes through as 2 rows (oneDNN's bf16 GEMM
    costs the same for 1 and 2 rows) and decoding a token alone equals verifying it among drafts. float32 keeps GEMV
    (much cheaper than 2 rows; differences ~1e-6). Nor is a bf16 GEMM's row the same for every row count on every
    CPU: on an AMX Xeon, 33+ rows of SmolLM2's gate/up and LM-head GEMMs rounded differently from 2-32 (an AMD CPU
    gave every count of 2+ the same row), so row_block (decode and verify) runs bf16 inputs in blocks of at most
    that many rows. A `Bf16Weight` (CPUs without native bfloat16) runs the compiled kernel, whose rows are the same
    for any row count."""
    if isinstance(weight, cpu_kernels.Bf16Weight):
        return weight.linear(x, bias, row_invariant=row_block is not None)
    if x.device.type == "cpu" and x.dtype != torch.float32:
        rows = x.numel() // x.shape[-1]
        if rows == 1:
            return linear(torch.cat([x, x], dim=-2), weight, bias)[..., :1, :]
        if row_block is not None and rows > row_block:
            flat = x.reshape(rows, x.shape[-1])
            out = torch.cat([linear(flat[a: a + row_block], weight, bias) for a in range(0, rows, row_block)])
            return out.view(*x.shape[:-1], out.shape[-1])
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


# On the CPU, decode and verify forwards (the runtime's verify steps at any width, other forwards of <= QUERY_BLOCK
# tokens) attend through the compiled kernel of
# inference/cpu_kernels.py, which computes each query row over its visible keys alone. Where it is absent (no C
# compiler at install; a GPU; static caches) they attend through `MatmulAttention`, so a token gets bitwise the
# same output decoded alone, verified in a chain, or verified as a tree node whose ancestors sit at scattered cache
# slots (the lossless check compares exactly that). SDPA flipped greedy tokens in bfloat16 for trees (3 of 16 MT-bench
# outputs at 128 tokens): its softmax sums keys in vectorised lanes, so a key's slot changes the rounding. float32
# GEMMs here round a row the same for any row count >= GEMM_MIN_ROWS (1-3 rows take another kernel;
# tests/test_runtime.py checks the equality), so decoding pads its query rows up to that.
# The key span is rounded up to SPAN_BLOCK (fewer distinct shapes; static ones for CUDA graphs), and the sum over
# keys runs as one GEMM per SPAN_BLOCK keys, added in order: how a float32 GEMM splits a long sum depends on its
# length on some CPUs (an AMX Xeon summed 1024 and 1536 keys differently, so a tree verified across a span boundary
# missed its decoded output by an ulp; one AMD CPU did the same for <= 256 against >= 384 keys), so every sum is
# over exactly SPAN_BLOCK keys (the last block of a static cache excepted: decode and verify share it). Blocks of
# 128 keys were tried for short spans: equal, but not measurably faster (session 7: 100-700 keys, batch 1, bf16).
# Work that needs no equality (regenerating training data) passes row_invariant=False: no padding, real span, and
# the softmax's own sum.
QUERY_BLOCK = 16
SPAN_BLOCK = 512
GEMM_MIN_ROWS = 8
ROW_BLOCK = 32  # bf16 decode / verify GEMMs run in blocks of at most this many rows (see `linear`)


class MatmulAttention:
    """Float32 matmul attention for one decode / verify forward, mask [B, 1, T, S] bool; called per layer with
    q [B, nh, T, hd], keys/values [B, kvh, S, hd] -> [B, nh, T, hd].

    Every sum over keys runs inside a GEMM, the softmax denominator too (a column of ones beside the values), and a
    GEMM accumulates each output element over the keys in order: a masked key adds an exact zero wherever it sits.
    So a query's output depends only on its visible keys in slot order, not on their slots or the span, once the
    GEMMs have enough rows (exact_rows: the queries padded to that many rows with copies of the last).
    exact_rows=None: no padding, GEMMs and softmax in the input dtype (scores in float32), for work that needs no
    equality (regeneration): 1.7x faster than SDPA's flash kernel for 64 rows of one query each over 200 keys.
    What depends on the mask alone (its expansion to the GEMMs' rows as an additive -inf bias, the float32 key and
    value buffers with their column of ones) is built once per forward and serves every layer: per layer it made a
    SmolLM2 decode step's attention ~15% slower at 512 keys and ~30% at 1024 (bf16, 2 threads)."""

    def __init__(self, mask: Tensor, num_heads: int, kv_heads: int, head_dim: int, exact_rows: int | None):
        B, _, T, S = mask.shape
        self.exact, self.rows = exact_rows is not None, max(T, exact_rows or T)
        if self.rows > T:
            mask = torch.cat([mask, mask[:, :, -1:].expand(B, 1, self.rows - T, S)], dim=2)
        g = num_heads // kv_heads  # query heads per key/value head (GQA), kv head j serving heads j*g .. j*g+g-1
        visible = mask.view(B, 1, 1, self.rows, S).expand(B, kv_heads, g, self.rows, S)
        self.bias = torch.zeros(visible.shape, device=mask.device).masked_fill_(~visible, float("-inf"))
        self.bias = self.bias.view(B, kv_heads, g * self.rows, S)
        if self.exact:
            self.keys = torch.empty(B, kv_heads, S, head_dim, device=mask.device)
            self.values = torch.ones(B, kv_heads, S, head_dim + 1, device=mask.device)  # last column: ones

    def __call__(self, q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        B, nh, T, hd = q.shape
        kvh, rows = keys.shape[1], self.rows
        g = nh // kvh
        if not self.exact:  # the g query heads of a kv head as rows of one GEMM, in the cache's dtype
            # keys/values are a span of the cache's max_len slots. In bfloat16, batched GEMMs over that strided view
            # are slower than a contiguous copy plus the GEMMs: a 64-row SmolLM2 decode step 155 -> 141 / 200 -> 171 /
            # 259 -> 200 ms over 120 / 250 / 400 keys (2 threads, AMX Xeon). In float32 the copy is the slower way:
            # 178 -> 166 / 326 -> 248 ms over 100 / 300 keys without it (2 threads, AVX-512 Xeon, interleaved medians)
            # where the CPU has no native bfloat16 its bf16 GEMMs are emulated (12.5 ms a GEMM here, 45% of a 64-row
            # regeneration step, AMD EPYC with AVX2): the copies are made float32 instead
            work = torch.float32 if cpu_kernels.emulates_bf16(q) else q.dtype
            keys, values = keys.to(work), values.to(work)
            if work != torch.float32:
                keys, values = keys.contiguous(), values.contiguous()
            scores = (q.reshape(B, kvh, g * T, hd).to(work) @ keys.transpose(-1, -2)).float() * hd**-0.5
            weights = (scores + self.bias).softmax(-1).to(work)
            return (weights @ values).view(B, nh, T, hd).to(q.dtype)
        if rows > T:
            q = torch.cat([q, q[:, :, -1:].expand(B, nh, rows - T, hd)], dim=2)
        keys = keys if keys.dtype == torch.float32 else self.keys.copy_(keys)
        self.values[..., :hd].copy_(values)
        scores = (q.float().reshape(B, kvh, g * rows, hd) @ keys.transpose(-1, -2)) * hd**-0.5
        scores += self.bias
        weights = (scores - scores.amax(-1, keepdim=True)).exp_()
        acc = weights[..., :SPAN_BLOCK] @ self.values[:, :, :SPAN_BLOCK]
        for a in range(SPAN_BLOCK, keys.shape[2], SPAN_BLOCK):  # one GEMM per SPAN_BLOCK keys, added in order
            acc = acc + weights[..., a: a + SPAN_BLOCK] @ self.values[:, :, a: a + SPAN_BLOCK]
        out = (acc[..., :hd] / acc[..., hd:]).view(B, nh, rows, hd)[:, :, :T]
        return out.to(q.dtype)


def runtime_supports(target: Target) -> bool:
    """Llama-style targets (silu MLP; llama, qwen2) run on the compact forward and so on the runtime."""
    cfg = target.model.config
    return getattr(cfg, "hidden_act", "silu") == "silu" and cfg.model_type in ("llama", "qwen2")


def compact_forward(target: Target) -> "LlamaForward":
    """The target's compact forward, built once per target and freed with it: feature extraction, online features and
    RL's block scoring share it (on CPU each LlamaForward packs its own copy of the float32 weights)."""
    if "compact_forward" not in target.derived:
        target.derived["compact_forward"] = LlamaForward(target)
    return target.derived["compact_forward"]


class LlamaForward:
    def __init__(self, target: Target, pack_weights: bool = True, row_invariant: bool = True):
        self.target = target
        self.row_invariant = row_invariant  # False: faster decoding, not bitwise equal to verification
        self._row_block = None  # ROW_BLOCK during a row-invariant decode / verify forward (set by forward)
        hf = target.model.model
        cfg = target.model.config
        if not runtime_supports(target):
            raise DraftheadsError(f"the runtime's compact forward covers Llama-style models (silu MLP); target "
                                  f"'{target.name}' is '{cfg.model_type}' with {cfg.hidden_act}; "
                                  "use inference.generate for it")
        # plain references to the target's parameters (packed on CPU): no nn.Module call overhead per linear
        pack = pack_for_cpu if pack_weights else (lambda w: w)

        def wb(m):
            return pack(m.weight), m.bias

        self.layers = [  # per layer: ln1, (q, k, v), o, ln2, (gate, up), down
            (layer.input_layernorm.weight,
             Projections([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], pack_weights),
             wb(layer.self_attn.o_proj), layer.post_attention_layernorm.weight,
             Projections([layer.mlp.gate_proj, layer.mlp.up_proj], pack_weights), wb(layer.mlp.down_proj))
            for layer in hf.layers
        ]
        self.eps = cfg.rms_norm_eps
        self.norm_weight = hf.norm.weight
        self.rotary = hf.rotary_emb  # the target's own RoPE (theta, scaling type) -> exact cos/sin
        self.embed_weight = hf.embed_tokens.weight
        lm_head = target.model.get_output_embeddings()
        self.lm_head = (pack(lm_head.weight), lm_head.bias)
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_layers = cfg.num_hidden_layers
        self.layer_ids = target.layer_ids
        # inference/cpu_kernels.py: compiled attention, RMSNorm and RoPE on the CPU for decode / verify forwards on
        # dynamic caches (static ones, for CUDA graphs and torch.compile, take no host calls). Prefills and feature
        # extraction keep torch's ops: multi-threaded for long inputs, and bitwise HF's float32 hidden states.
        self.cpu_kernels = cpu_kernels.supported(target.device, target.dtype, self.num_heads, self.kv_heads,
                                                 self.head_dim, cfg.hidden_size)
        self._kernels = False  # set per forward

    def new_cache(self, batch_size: int, max_len: int, static: bool = False) -> StaticKVCache:
        return StaticKVCache(self.num_layers, batch_size, self.kv_heads, self.head_dim, max_len,
                             dtype=self.target.dtype, device=self.target.device, static=static)

    def _attention(self, layer: int, x: Tensor, cos: Tensor, sin: Tensor, cache: StaticKVCache, rows: Tensor,
                   read: slice | Tensor, slots: Tensor, span: int, mask: Tensor,
                   attend: MatmulAttention | CompiledAttention | None) -> Tensor:
        _, qkv, o_proj = self.layers[layer][:3]
        B, T, _ = x.shape
        q, k, v = qkv(x, self._linear)
        q = q.reshape(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, nh, T, hd]
        k = k.reshape(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, kvh, T, hd]
        v = v.reshape(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        if self._kernels:
            q, k = cpu_kernels.rope(q, cos, sin), cpu_kernels.rope(k, cos, sin)
        else:
            q = q * cos + rotate_half(q) * sin  # cos, sin [B, 1, T, hd]
            k = k * cos + rotate_half(k) * sin
        keys, values = cache.write(layer, k, v, rows, slots, span, read)  # [B, kvh, S, hd]
        if attend is not None:  # decode / verify (see QUERY_BLOCK)
            out = attend(q, keys, values)
        else:  # prefill: SDPA's fused kernels
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                                 enable_gqa=self.kv_heads != self.num_heads)  # [B, nh, T, hd]
        return self._linear(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim), *o_proj)

    def _linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return linear(x, weight, bias, self._row_block)

    def _mlp(self, layer: int, x: Tensor) -> Tensor:
        gate_up, down = self.layers[layer][4:]
        gate, up = gate_up(x, self._linear)
        return self._linear(F.silu(gate) * up, *down)

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
        context_limit: Tensor | None = None,  # [B, T] committed slots each new token sees (default: all)
        verify: bool | None = None,  # a decode / verify step (True: the runtime's, any T); None: T <= QUERY_BLOCK
    ) -> TargetOutput:
        B, T = input_ids.shape
        step = T <= QUERY_BLOCK if verify is None else verify  # decode / verify: the paths below, row-invariant
        rows = cache.all_rows() if rows is None else rows
        slots = cache.slots(rows, T)  # [B, T], also checks max_len
        read = cache.reader(rows)
        span = cache.span(slots)
        self._kernels = self.cpu_kernels and not cache.static and step
        compiled = self._kernels and self.row_invariant
        if self.row_invariant and step and not cache.static and not compiled:
            span = min(cache.max_len, -(-span // SPAN_BLOCK) * SPAN_BLOCK)
        self._row_block = ROW_BLOCK if self.row_invariant and step else None
        tree_mask_given = tree_mask is not None
        if tree_mask is None:
            tree_mask = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril().expand(B, T, T)
        positions = slots if position_offsets is None else cache.lengths[rows][:, None] + position_offsets
        # an empty cache and a chain: plain causal attention (SDPA's fused causal kernel, ~5% faster prefill)
        causal = tree_mask_given is False and span == T
        mask = None if causal else cache.attention_mask(rows, slots, tree_mask, span, context_limit)  # [B, 1, T, S]
        attend = None
        if compiled and mask is not None:  # decode / verify on the CPU (inference/cpu_kernels.py)
            attend = CompiledAttention(mask, self.head_dim)
        elif mask is not None and step and mask.dtype == torch.bool:  # decode / verify (see QUERY_BLOCK)
            exact_rows = -(-GEMM_MIN_ROWS // (self.num_heads // self.kv_heads)) if self.row_invariant else None
            attend = MatmulAttention(mask, self.num_heads, self.kv_heads, self.head_dim, exact_rows)
        h = F.embedding(input_ids, self.embed_weight)  # [B, T, H]
        cos, sin = self.rotary(h, positions)  # [B, T, hd]
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, hd], broadcast over heads
        norm = cpu_kernels.rms_norm if self._kernels else rms_norm
        captured = {}
        for i, weights in enumerate(self.layers):
            if i in self.layer_ids:
                captured[i] = h
            x = norm(h, weights[0], self.eps)
            h = h + self._attention(i, x, cos, sin, cache, rows, read, slots, span, mask, attend)
            h = h + self._mlp(i, norm(h, weights[3], self.eps))
        captured[self.num_layers] = h  # last layer output, pre-norm (layer id L)
        final = norm(h, self.norm_weight, self.eps)  # [B, T, H]
        aux = torch.cat([captured[i] for i in self.layer_ids], dim=-1)  # [B, T, n*H]
        logits = None
        if compute_logits:
            picked = final if logits_at is None else torch.gather(
                final, 1, logits_at[..., None].expand(-1, -1, final.shape[-1]))
            logits = self._linear(picked, *self.lm_head)  # [B, T or T', V]
        return TargetOutput(logits, aux, final, None)

    __call__ = forward
