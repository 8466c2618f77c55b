"""DSpark: a semi-autoregressive block drafter (parallel backbone + sequential stage + confidence head).

Backbone (DFlash-style, "dflash" = this alone). Features row t = target hidden states after reading x_0..x_t
(the ~5 target layers of target.layer_ids, concatenated). context_t = RMSNorm(fc(aux_t)) is injected as EXTRA
keys/values into every draft layer (that layer's k/v projections, RoPE at position t). A block for anchor a is
    input    [embed(x_{a+1}); mask_embedding x (gamma-1)]      positions a+1 .. a+gamma
and its queries see context rows <= a and the whole block (bidirectional inside it), nothing else. Slot k
(k = 1..gamma) predicts x_{a+k+1}; its label is the target's distribution at row a+k (as P-EAGLE's depth k).
The block always has gamma slots (slot 1 attends to slot gamma), so inference with k < gamma runs all gamma.

Sequential stage ("dspark"): logits_k = backbone_k + e_k @ W2, sampled LEFT TO RIGHT so each token has an exact q:
    markov  e_k = W1[x_{k-1}]       (x_0 = the anchor token x_{a+1}; W1 [V_draft+1, r], W2 [r, V_draft])
    gated   as markov, the bias W2 (e_k * sigmoid(G h_k)): the backbone's state decides which of the previous
            token's r directions count at slot k (G [r, H]; vLLM speculators' "gated")
    rnn     e_k = GRUCell(W1[x_{k-1}], e_{k-1}), e_0 = 0
Confidence head: c_k = sigmoid(w^T [h_k; e_k] / tau_k) = P(draft k survives | drafts < k accepted); tau_k are
per-position temperatures fitted by train/calibration.py (buffer, default 1). Its input is detached: the probe
must not trade draft quality for predictability.

Training rows carry hidden = [h_k; e_k] ([N, H + r]): `logits_for` and `confidence_logit` read only that, so the
trainer's chunked losses and train/rl.py treat DSpark like any head. Embedding and LM head are the target's
(frozen, shared, not saved); a draft vocabulary gets its own lm_head rows + d2t/t2d, exactly as P-EAGLE.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.draft_vocab import DraftVocab, to_draft_ids
from models.errors import DraftheadsError
from models.layers import TrainableHead
from models.peagle import (DecoderLayer, DraftCache, DraftTrainOutput, PEagleDrafter, RMSNorm, apply_rotary,
                           head_rope_scaling, rotary, target_layer_sizes)

SEQUENTIAL = ("markov", "gated", "rnn", "none")


class DSparkDrafter(TrainableHead):
    feature = "aux_hidden"  # which DraftContext features draft_logits reads

    # target wiring and the draft-vocab head are P-EAGLE's (same attributes: _shared, lm_head, d2t, t2d)
    attach_target = PEagleDrafter.attach_target
    draft_ids = PEagleDrafter.draft_ids
    embed = PEagleDrafter.embed
    logits = PEagleDrafter.logits
    full_vocab_logits = PEagleDrafter.full_vocab_logits

    def __init__(self, hidden_size: int, num_aux_layers: int, num_layers: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, intermediate_size: int, vocab_size: int, k: int, sequential: str = "markov",
                 rank: int = 256, draft_vocab_size: int | None = None, rms_norm_eps: float = 1e-5,
                 rope_theta: float = 10000.0, rope_scaling: dict | None = None, confidence_grad: bool = False):
        super().__init__()
        if sequential not in SEQUENTIAL:
            raise DraftheadsError(f"draft.extra.sequential '{sequential}' is not one of {list(SEQUENTIAL)}")
        rope_scaling = head_rope_scaling(rope_scaling, head_dim, rope_theta)
        self.config = dict(hidden_size=hidden_size, num_aux_layers=num_aux_layers, num_layers=num_layers,
                           num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           intermediate_size=intermediate_size, vocab_size=vocab_size, k=k, sequential=sequential,
                           rank=rank, draft_vocab_size=draft_vocab_size, rms_norm_eps=rms_norm_eps,
                           rope_theta=rope_theta, rope_scaling=rope_scaling, confidence_grad=confidence_grad)
        self.confidence_grad = confidence_grad
        self.k, self.sequential, self.head_dim, self.rope_theta = k, sequential, head_dim, rope_theta
        self.rope_scaling = rope_scaling
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        H = hidden_size
        self.fc = nn.Linear(num_aux_layers * H, H, bias=False)
        self.context_norm = RMSNorm(H, rms_norm_eps)
        self.layers = nn.ModuleList(
            DecoderLayer(False, H, num_heads, num_kv_heads, head_dim, intermediate_size, rms_norm_eps, False)
            for _ in range(num_layers))
        self.norm = RMSNorm(H, rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.randn(H) * 0.02)
        n_draft = vocab_size
        if draft_vocab_size is not None and draft_vocab_size < vocab_size:
            n_draft = draft_vocab_size
            self.lm_head = nn.Linear(H, draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))
        self.rank = 0 if sequential == "none" else rank
        if self.rank:
            self.W1 = nn.Embedding(n_draft + 1, rank)  # row n_draft: a previous token outside the draft vocab
            nn.init.normal_(self.W1.weight, std=0.02)
            self.W2 = nn.Linear(rank, n_draft, bias=False)
            nn.init.zeros_(self.W2.weight)  # starts as the plain backbone
            if sequential == "rnn":
                self.gru = nn.GRUCell(rank, rank)
            if sequential == "gated":
                self.gate = nn.Linear(H, rank)
                nn.init.zeros_(self.gate.weight)  # starts at sigmoid(0) = 1/2 on every direction
                nn.init.zeros_(self.gate.bias)
        self.confidence = nn.Linear(H + self.rank, 1)
        self.register_buffer("confidence_temperature", torch.ones(k))
        self._shared: dict[str, nn.Module] = {}  # frozen target modules: NOT parameters of the head, not saved

    @property
    def family_name(self) -> str:
        return "dflash" if self.sequential == "none" else "dspark"

    # -- pieces ----------------------------------------------------------------------------------
    def draft_rows(self, ids: Tensor) -> Tensor:
        """Target ids -> W1 rows (draft-vocab index; tokens outside the draft vocab share the last row)."""
        if not hasattr(self, "d2t"):
            return ids
        return to_draft_ids(self.t2d, ids, outside=self.d2t.numel())

    def sequential_features(self, prev: Tensor) -> Tensor:
        """prev [..., S] target ids x_{k-1} of slots 1..S -> e [..., S, r] (r = 0 for dflash)."""
        if not self.rank:
            return prev.new_zeros((*prev.shape, 0), dtype=self.fc.weight.dtype)
        e = self.W1(self.draft_rows(prev))
        if self.sequential != "rnn":  # markov, gated (its gate reads h_k: logits_for)
            return e
        state, out = e.new_zeros(e[..., 0, :].shape), []
        for s in range(e.shape[-2]):
            state = self.gru(e[..., s, :].reshape(-1, self.rank), state.reshape(-1, self.rank)).view(state.shape)
            out.append(state)
        return torch.stack(out, -2)

    def logits_for(self, hidden: Tensor, depth: Tensor | None = None) -> Tensor:
        """hidden [N, H + r] = [h_k; e_k] -> Markov-biased logits [N, V_draft]."""
        H = self.hidden_size
        h, e = hidden[..., :H], hidden[..., H:]
        base = self.logits(h)
        if not self.rank:
            return base
        if self.sequential == "gated":
            e = e * torch.sigmoid(self.gate(h))
        return base + self.W2(e)

    def confidence_logit(self, hidden: Tensor, depth: Tensor) -> Tensor:
        """[N]: logit of c_k (calibrated by the per-position temperature), from [h_k; e_k], detached unless the head
        was built with confidence_grad (then the BCE shapes the features the logits read too)."""
        hidden = hidden if self.confidence_grad else hidden.detach()
        return self.confidence(hidden).squeeze(-1) / self.confidence_temperature[depth - 1]

    def context_kv(self, layer, context: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """context [B, n, H] -> this layer's (k, v) [B, kvh, n, hd] of the context rows (RoPE at their positions)."""
        attn = layer.self_attn
        B, n, _ = context.shape
        k = attn.k_proj(context).view(B, n, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(context).view(B, n, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def contexts(self, aux: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """aux [B, n, nH], positions [B, n] -> per layer (k, v) of the context rows."""
        context = self.context_norm(self.fc(aux.to(self.fc.weight.dtype)))
        cos, sin = rotary(positions, self.head_dim, self.rope_theta, self.rope_scaling)
        return [self.context_kv(layer, context, cos, sin) for layer in self.layers]

    def backbone(self, first_ids: Tensor, positions: Tensor, context_kv, mask: Tensor | None) -> Tensor:
        """Blocks [B, A] of anchor tokens x_{a+1}, slot positions [B, A*gamma] -> normed h [B, A, gamma, H]."""
        B, A = first_ids.shape
        first = self.embed(first_ids)[:, :, None]  # [B, A, 1, H]
        x = torch.cat([first, self.mask_embedding.to(first.dtype).expand(B, A, self.k - 1, first.shape[-1])], 2)
        x = x.reshape(B, A * self.k, -1)
        cos, sin = rotary(positions, self.head_dim, self.rope_theta, self.rope_scaling)
        for layer, past in zip(self.layers, context_kv):
            x, _ = layer(None, x, cos, sin, mask, past)
        return self.norm(x).view(B, A, self.k, -1)

    # -- training --------------------------------------------------------------------------------
    def train_forward(self, batch: dict, plan) -> DraftTrainOutput:
        """Blocks for every distinct anchor of the plan's labelled rows; rows teacher-force x_{k-1} = x_{a+k}
        (or batch["slot_tokens"], the token each plan column reads, when given: RL's sampled blocks).

        `plan` is a train.cod.CodPlan: `anchor_plan` (stage 1) or train/rl.py's block_plan (stage 2); only the
        (anchor, depth) of rows with valid & trained matter. Output rows keep the plan's row-major order.
        """
        ids, aux = batch["input_ids"], batch["aux_hidden"]  # [B, T], [B, T, nH]
        B, T = ids.shape
        keep = plan.valid & plan.trained  # [B, N]
        anchors = [torch.unique(plan.anchor[b][keep[b]]) for b in range(B)]  # sorted
        A = max(1, max(a.numel() for a in anchors))
        block_anchor = ids.new_zeros(B, A)
        block_of = torch.zeros_like(plan.anchor)  # [B, N] block index of each column
        for b, a in enumerate(anchors):
            block_anchor[b, : a.numel()] = a
            if a.numel():
                block_of[b] = torch.searchsorted(a, plan.anchor[b]).clamp(max=a.numel() - 1)
        slot = torch.arange(self.k, device=ids.device)
        pos = (block_anchor[..., None] + 1 + slot).view(B, A * self.k)  # [B, A*gamma]
        q_anchor = block_anchor.repeat_interleave(self.k, 1)  # [B, A*gamma]
        ctx_ok = torch.arange(T, device=ids.device)[None, None] <= q_anchor[..., None]  # [B, A*gamma, T]
        blk = torch.arange(A, device=ids.device).repeat_interleave(self.k)
        same_block = (blk[:, None] == blk[None]).expand(B, -1, -1)  # [B, A*gamma, A*gamma]
        mask = torch.cat([ctx_ok, same_block], -1)[:, None]
        context_kv = self.contexts(aux, torch.arange(T, device=ids.device).expand(B, T))
        h = self.backbone(ids.gather(1, (block_anchor + 1).clamp(max=T - 1)), pos, context_kv, mask)
        prev = ids.gather(1, pos.clamp(max=T - 1)).view(B, A, self.k)  # x_{a+k} for slot k
        if "slot_tokens" in batch:  # the tokens each (anchor, depth) column reads, when not the sequence's own
            b_keep = torch.arange(B, device=ids.device)[:, None].expand_as(keep)[keep]
            prev = prev.index_put((b_keep, block_of[keep], plan.depth[keep] - 1), batch["slot_tokens"][keep])
        hidden = torch.cat([h, self.sequential_features(prev).to(h.dtype)], -1)  # [B, A, gamma, H + r]
        b_idx = torch.arange(B, device=ids.device)[:, None].expand_as(keep)
        rows = hidden[b_idx[keep], block_of[keep], plan.depth[keep] - 1]
        return DraftTrainOutput(rows, b_idx[keep], plan.anchor[keep], plan.depth[keep])


    # -- inference -------------------------------------------------------------------------------
    @torch.no_grad()
    def draft(self, tokens: Tensor, aux: Tensor, cache: DraftCache, k: int, sample_fn=None) -> tuple[Tensor, Tensor]:
        """(logits [k, V_draft], confidences [k]) for the k tokens after `tokens` [T]; aux [T-1, nH] = features of
        tokens[:-1]. Row j's logits are biased by the token drafted at j-1 (sample_fn(logits [V_draft]) -> target
        id, called for rows 1..k-1; None = greedy), so softmax of row j IS the q token j was drawn from."""
        n_ctx = tokens.numel() - 1
        start = cache.valid_prefix(tokens, n_ctx)
        new_kv = self.contexts(aux[None, start:n_ctx], torch.arange(start, n_ctx, device=tokens.device)[None])
        cache.append(tokens, new_kv, n_ctx)
        pos = torch.arange(n_ctx, n_ctx + self.k, device=tokens.device)[None]  # anchor a = n_ctx - 1
        h = self.backbone(tokens[None, -1:], pos, cache.kv, None)[0, 0]  # [gamma, H]; sees all context + block
        if sample_fn is None:
            ids = self.draft_ids
            sample_fn = (lambda lg: lg.argmax()) if ids is None else (lambda lg: ids[lg.argmax()])
        logits, conf, prev, state = [], [], tokens[-1:], None
        for j in range(k):
            e = self.sequential_step(prev, state)  # [1, r]
            row = torch.cat([h[j: j + 1], e.to(h.dtype)], -1)
            logits.append(self.logits_for(row)[0])
            conf.append(torch.sigmoid(self.confidence_logit(row, torch.tensor([j + 1], device=h.device)))[0])
            if j + 1 < k:
                prev, state = sample_fn(logits[-1]).view(1), e
        return torch.stack(logits), torch.stack(conf)

    def sequential_step(self, prev: Tensor, state: Tensor | None) -> Tensor:
        """One left-to-right step of the sequential stage: prev [1] target id -> e [1, r]."""
        if self.sequential != "rnn":
            return self.sequential_features(prev[None])[0]
        e = self.W1(self.draft_rows(prev))
        return self.gru(e, torch.zeros_like(e) if state is None else state)

    def draft_logits(self, tokens: Tensor, aux: Tensor, cache: DraftCache, k: int, sample_fn=None) -> Tensor:
        """The drafting interface P-EAGLE heads share (inference/sources/draft_head.py, train/rl.py)."""
        return self.draft(tokens, aux, cache, k, sample_fn)[0]


def dspark_for_target(target, k: int, num_layers: int = 1, draft_vocab: DraftVocab | None = None,
                      sequential: str = "markov", rank: int = 256, confidence_grad: bool = False) -> DSparkDrafter:
    """A fresh head sized from the target's config (heads, head dim, MLP width, RoPE theta and scaling)."""
    head = DSparkDrafter(**target_layer_sizes(target), num_layers=num_layers, k=k, sequential=sequential, rank=rank,
                         draft_vocab_size=None if draft_vocab is None else draft_vocab.size,
                         confidence_grad=confidence_grad)
    return head.to(target.dtype).attach_target(target, draft_vocab, fresh=True)
