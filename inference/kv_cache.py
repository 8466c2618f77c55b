"""Static KV cache: preallocated per layer, one row per request, rollback by moving a length.

Layout per layer: k, v [B, kv_heads, max_len, head_dim]. Request b owns slots 0..lengths[b]-1 of its row
(slot index == position id, no left padding). A forward over T new tokens writes them at slots
lengths[b] .. lengths[b]+T-1 *before* they are committed; `commit` then moves lengths[b] forward by the
number that survived verification. Rejected drafts are never erased: slots >= lengths[b] are masked out by
`attention_mask` and overwritten by the next forward. Nothing is allocated after construction, so memory
is flat over any generation length (tests/test_runtime.py checks a 2,048-token run).

A forward may cover a subset of the rows (`rows`, the requests of one draft-length group). `static=True`
(the CUDA-graph path) always reads all max_len slots so every shape depends on (rows, T) only, and never
reads a tensor value back to the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.errors import DraftheadsError


class StaticKVCache:
    def __init__(self, num_layers: int, batch_size: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", static: bool = False):
        shape = (batch_size, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B] committed slots
        self.max_len, self.batch_size, self.static = max_len, batch_size, static

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def reset(self) -> None:
        self.lengths.zero_()

    def all_rows(self) -> Tensor:
        return torch.arange(self.batch_size, device=self.lengths.device)

    # -- a forward over T new tokens of the requests `rows` -----------------------------------------
    def slots(self, rows: Tensor, num_new: int) -> Tensor:
        """Cache slots [R, T] the next num_new tokens of each request in rows [R] are written to."""
        lengths = self.lengths[rows]
        if not self.static:
            need = int(lengths.max()) + num_new
            if need > self.max_len:
                raise DraftheadsError(
                    f"KV cache holds {self.max_len} positions but this step needs {need} (prompt + generated + "
                    f"draft); raise the runtime's max_len or shorten the prompt / --max-new"
                )
        return lengths[:, None] + torch.arange(num_new, device=rows.device)

    def span(self, slots: Tensor) -> int:
        return self.max_len if self.static else int(slots.max()) + 1

    def reader(self, rows: Tensor) -> slice | Tensor:
        """How a forward over requests `rows` reads the cache, decided once per forward: consecutive rows as a slice (a
        view, nothing copied), any other set as the rows to gather in every layer. A static cache reads all its rows as
        a slice, and a subset by gathering (its rows' values may change between CUDA-graph replays): `rows` of a full
        batch must then be 0..R-1 in order (deciding by value would need a host sync inside the graph)."""
        R = rows.numel()
        if self.static:
            return slice(0, R) if R == self.batch_size else rows
        first = int(rows[0])
        if R == 1 or bool((rows == torch.arange(first, first + R, device=rows.device)).all()):
            return slice(first, first + R)
        return rows

    def write(self, layer: int, k_new: Tensor, v_new: Tensor, rows: Tensor, slots: Tensor, span: int,
              read: slice | Tensor):
        """Store k/v_new [R, kvh, T, hd] at slots [R, T]; return the readable keys/values [R, kvh, span, hd]
        (`read` = reader(rows))."""
        kc, vc = self.k[layer], self.v[layer]
        R, T = slots.shape
        if not self.static and R == 1:  # one request: a copy into its row, without reading the slots on the host
            kc[read.start].index_copy_(1, slots[0], k_new[0])  # (a CUDA sync in each of the target's layers)
            vc[read.start].index_copy_(1, slots[0], v_new[0])
        else:
            row_idx = rows[:, None].expand(R, T)
            kc[row_idx, :, slots] = k_new.transpose(1, 2)  # advanced dims first: [R, T, kvh, hd]
            vc[row_idx, :, slots] = v_new.transpose(1, 2)
        if isinstance(read, slice):
            return kc[read, :, :span], vc[read, :, :span]
        return kc[:, :, :span].index_select(0, rows), vc[:, :, :span].index_select(0, rows)

    def attention_mask(self, rows: Tensor, slots: Tensor, tree_mask: Tensor, span: int,
                       context_limit: Tensor | None = None) -> Tensor:
        """Boolean mask [R, 1, T, span]: query j of request b sees every committed slot (< lengths[b], or
        < context_limit[b, j] when given: a draft block rooted inside the context) and the new slots its
        tree_mask [R, T, T] allows (ancestors and itself; causal for a chain)."""
        R, T = slots.shape
        lengths = self.lengths[rows]
        key = torch.arange(span, device=slots.device)  # [S]
        limit = lengths[:, None, None] if context_limit is None else context_limit[..., None]  # [R, 1 or T, 1]
        committed = key[None, None, :] < limit  # [R, 1 or T, S]
        rel = key[None, :] - lengths[:, None]  # [R, S] index of slot s among the new tokens
        in_new = (rel >= 0) & (rel < T)
        new_visible = torch.gather(tree_mask, 2, rel.clamp(0, T - 1)[:, None, :].expand(R, T, span))
        return (committed | (new_visible & in_new[:, None]))[:, None]

    # -- commit / rollback -----------------------------------------------------------------------------
    def commit(self, rows: Tensor, num_kept: Tensor) -> None:
        """Keep the first num_kept[r] tokens just written for each request in rows (already compacted)."""
        self.lengths.index_add_(0, rows, num_kept.to(self.lengths))

    def rollback(self, rows: Tensor, lengths: Tensor) -> None:
        """Truncate requests to lengths[r] committed positions: no copy, the slots are simply reused."""
        self.lengths[rows] = torch.minimum(self.lengths[rows], lengths.to(self.lengths))

    def move_row(self, src: int, dst: int) -> None:
        """Request row src's committed keys/values and length into row dst (dst's are dropped): the runtime packs the
        requests still decoding into the lowest rows so that a forward over all of them reads one slice."""
        n = int(self.lengths[src])
        for kc, vc in zip(self.k, self.v):
            kc[dst, :, :n] = kc[src, :, :n]
            vc[dst, :, :n] = vc[src, :, :n]
        self.lengths[dst] = n

    def compact(self, row: int, src_slots: Tensor, dst_start: int) -> None:
        """Tree verification: move the accepted path's K/V from src_slots [n] (increasing) to the contiguous
        slots dst_start .. dst_start+n-1 of one request. Chains never need this: their path is in place."""
        n = src_slots.numel()
        dst = torch.arange(dst_start, dst_start + n, device=src_slots.device)
        moved = src_slots != dst
        if not bool(moved.any()):
            return
        src, dst = src_slots[moved], dst[moved]
        for kc, vc in zip(self.k, self.v):
            kc[row, :, dst] = kc[row, :, src]  # advanced-index read makes a copy before the write
            vc[row, :, dst] = vc[row, :, src]
