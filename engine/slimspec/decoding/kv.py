"""A batched KV cache with holes, for ragged speculative decoding.

One cache per model holds every row at a common length L. Each slot is valid
(a real token of that row) or a hole (a rejected draft token, or padding). Holes
are never attended to: every forward gets an explicit 4D additive mask built
from `valid`, plus explicit position ids, so rolling back a rejection is just
marking slots invalid -- no per-row crop. When holes pile up, compact() moves
each row's valid slots to the right and drops the empty columns.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

GROW_MIN = 64  # spare slots at least, when a layer's room is (re)made


def _room_for(
    cur: torch.Tensor, room: torch.Tensor | None, like: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """A room whose first L slots are cur (B, H, L, d) and that has spare slots for the
    T of like (B, H, T, d): room itself when cur is its first L slots (a view) and they
    fit, else fresh room (cur copied in, spare slots for growth); (room, L)."""
    n, t = (cur.shape[-2] if cur.dim() == 4 else 0), like.shape[-2]
    fits = (
        room is not None
        and n > 0
        and cur.data_ptr() == room.data_ptr()
        and cur.shape[:2] == room.shape[:2]
        and cur.shape[-1] == room.shape[-1]
        and cur.stride() == room.stride()
        and cur.dtype == room.dtype == like.dtype
        and n + t <= room.shape[-2]
    )
    if not fits:
        b, h, _, d = like.shape
        room = like.new_empty(b, h, n + t + max(GROW_MIN, (n + t) // 2), d)
        if n:
            room[:, :, :n] = cur
    assert room is not None
    return room, n


def _appended(
    cur: torch.Tensor, room: torch.Tensor | None, new: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cur (B, H, L, d) with new (B, H, T, d) appended along L, written into room's spare
    slots when cur is room's first L slots (a view), else into fresh room with spare
    slots: (the (B, H, L + T, d) view, its room)."""
    room, n = _room_for(cur, room, new)
    t = new.shape[-2]
    room[:, :, n : n + t] = new
    return room[:, :, : n + t], room


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose update writes the new slots into spare room behind the
    cached ones instead of concatenating (a copy of the whole layer's keys and values
    every forward: ~4% of the decode time with 8 rows of 400-token prompts on 2 cores,
    within noise for one row of 250). keys/values are
    views of that room (a stride of the room's length between heads); anything that
    replaces them with other tensors (compaction, row selection) gets fresh room on
    the next update."""

    _key_room: torch.Tensor | None = None
    _value_room: torch.Tensor | None = None
    # the keys/values views this layer last made: while keys and values are still
    # those very objects, they are their rooms' first slots (reserve's quick check)
    _views: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None  # set by the initialisation
        self.keys, self._key_room = _appended(self.keys, self._key_room, key_states)
        self.values, self._value_room = _appended(self.values, self._value_room, value_states)
        self._views = (self.keys, self.values)
        return self.keys, self.values

    def reserve(self, t: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """For a caller that writes t new slots itself (fused_draft's one-call step):
        (key room, value room, L) whose slots [0, L) hold the cached keys and values and
        [L, L + t) are free; `grown(t)` then takes those slots in. None where the layer
        holds no keys yet."""
        keys, values = self.keys, self.values
        if not self.is_initialized or keys is None or values is None or keys.dim() != 4:
            return None
        views, kr, vr = self._views, self._key_room, self._value_room
        n = keys.shape[-2]
        if (
            views is None
            or views[0] is not keys
            or views[1] is not values
            or kr is None
            or vr is None
            or n + t > kr.shape[-2]
            or n + t > vr.shape[-2]
        ):
            shape = (*keys.shape[:2], t, keys.shape[-1])
            kr, n = _room_for(keys, kr, keys.new_empty(shape))
            vr, _ = _room_for(values, vr, values.new_empty(shape))
            self.keys, self.values = kr[:, :, :n], vr[:, :, :n]
            self._key_room, self._value_room = kr, vr
            self._views = (self.keys, self.values)
        return kr, vr, n

    def grown(self, t: int) -> None:
        """Take in the t slots written after `reserve(t)`."""
        assert self.keys is not None and self._key_room is not None
        assert self._value_room is not None
        n = self.keys.shape[-2] + t
        self.keys, self.values = self._key_room[:, :, :n], self._value_room[:, :, :n]
        self._views = (self.keys, self.values)

    def reset(self) -> None:
        self._key_room = self._value_room = None
        self._views = None
        super().reset()


def native_room(room: torch.Tensor, b: int, heads: int, head_dim: int) -> bool:
    """A cache room a native step can write: (b, heads, rows, head_dim) bfloat16,
    contiguous."""
    return (
        room.dtype == torch.bfloat16
        and room.is_contiguous()
        and room.shape[:2] == (b, heads)
        and room.shape[-1] == head_dim
    )


class NativeRooms:
    """The cache rooms of a native step that writes a cache's new keys and values itself
    (the fused draft's and the target's one-call steps): every layer's room for t more
    slots (GrowingLayer.reserve), written into that layer's native struct (its k_room,
    v_room, k_room_rows and v_room_rows fields) only where the room changed since the
    last step. Weak references: a finished cache is freed."""

    def __init__(self, n_layers: int) -> None:
        self.seen: list[tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]] | None]
        self.seen = [None] * n_layers

    def reserve(
        self, cache: Any, t: int, n: int, structs: Any, shape: tuple[int, int, int]
    ) -> bool:
        """Room for t new slots behind the n cached ones in each of the first n_layers
        layers of cache, pointed at by structs[i]; False where a layer is not a
        GrowingLayer, holds another number of slots, or its room is not native_room's
        of shape (batch, kv heads, head_dim) (the caller then runs the usual per-layer
        path; rooms made anew on the way hold the same keys and values)."""
        layers = getattr(cache, "layers", None)
        if layers is None or len(layers) < len(self.seen) or getattr(cache, "offloading", False):
            return False
        for i, layer in enumerate(layers[: len(self.seen)]):
            room = layer.reserve(t) if isinstance(layer, GrowingLayer) else None
            if room is None or room[2] != n:
                return False
            kr, vr, _ = room
            last = self.seen[i]
            if last is not None and last[0]() is kr and last[1]() is vr:
                continue  # the last step's rooms: the native side points at them
            self.seen[i] = None
            if not all(native_room(r, *shape) for r in (kr, vr)):
                return False
            dst = structs[i]
            dst.k_room, dst.v_room = kr.data_ptr(), vr.data_ptr()
            dst.k_room_rows, dst.v_room_rows = kr.shape[2], vr.shape[2]
            self.seen[i] = (weakref.ref(kr), weakref.ref(vr))
        return True

    def grown(self, cache: Any, t: int) -> None:
        """Take in the t slots the native step wrote after `reserve`."""
        for layer in cache.layers[: len(self.seen)]:
            layer.grown(t)


def new_cache(config: Any) -> DynamicCache:
    """A DynamicCache for this model whose full-attention layers grow in place."""
    cache = DynamicCache(config=config)
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            layer.__class__ = GrowingLayer
    return cache


def attention_mask_4d(
    valid_old: torch.Tensor,
    new_real: torch.Tensor,
    dtype: torch.dtype,
    new_allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Additive mask (B, 1, q, L+q) for q new slots after L cached slots.

    A new query sees the valid cached slots, the real new slots it may attend
    (new_allowed (q, q) bool, causal by default; a tree of drafts passes its own), and
    always itself (so a padding query never has an empty row, which would give NaN).
    """
    b, q = new_real.shape
    causal = (
        torch.ones(q, q, dtype=torch.bool, device=new_real.device).tril()
        if new_allowed is None
        else new_allowed
    )
    new_part = causal.unsqueeze(0) & new_real.unsqueeze(1)  # (B, q, q): key j real and j <= i
    new_part = new_part | torch.eye(q, dtype=torch.bool, device=new_real.device).unsqueeze(0)
    old_part = valid_old.unsqueeze(1).expand(b, q, valid_old.shape[1])
    allowed = torch.cat([old_part, new_part], dim=2).unsqueeze(1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=new_real.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


class BatchKV:
    """A DynamicCache plus a (B, L) validity map. Rows are addressed by batch index."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = device
        self.cache: DynamicCache | None = None
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=device)

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def holes(self) -> torch.Tensor:
        """(B,) number of hole slots per row."""
        return (~self.valid).sum(dim=1)

    def _layers(self) -> list[DynamicLayer]:
        if self.cache is None:
            return []
        layers: list[DynamicLayer] = []
        for layer in self.cache.layers:
            if not isinstance(layer, DynamicLayer) or type(layer) not in (
                DynamicLayer,
                GrowingLayer,
            ):
                raise NotImplementedError(
                    "only full-attention models are supported by the batched cache, "
                    f"got {type(layer).__name__}"
                )
            layers.append(layer)
        return layers

    def mask_for(
        self, new_real: torch.Tensor, dtype: torch.dtype, new_allowed: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.cache is None:  # empty: start at the new batch size
            self.valid = torch.zeros(new_real.shape[0], 0, dtype=torch.bool, device=new_real.device)
        return attention_mask_4d(self.valid, new_real, dtype, new_allowed)

    def after_forward(self, cache: DynamicCache, new_valid: torch.Tensor) -> None:
        """Record the q slots a forward just appended; new_valid (B, q) says which are real."""
        self.cache = cache
        self.valid = torch.cat([self.valid, new_valid.to(torch.bool)], dim=1)
        expected = self.length
        for layer in self._layers():
            keys, _ = _filled(layer)
            if keys.shape[-2] != expected:
                raise RuntimeError(f"cache length {keys.shape[-2]} != mask length {expected}")

    def invalidate(self, slots: torch.Tensor) -> None:
        """Mark slots invalid: slots (B, L) bool, True = roll back."""
        self.valid &= ~slots

    def mark_valid(self, rows: torch.Tensor, cols: torch.Tensor) -> None:
        """Keep slot (rows[i], cols[i]) after all (an accepted sibling draft behind holes)."""
        self.valid[rows, cols] = True

    def invalidate_tail(self, start: int, keep: torch.Tensor) -> None:
        """Columns from `start` on: row b keeps its first keep[b]; the rest become holes."""
        n = self.length - start
        cols = torch.arange(n, device=self.valid.device).unsqueeze(0)
        drop = cols >= keep.unsqueeze(1)
        self.valid[:, start:] &= ~drop

    def select_rows(self, rows: list[int]) -> None:
        """Keep only these batch rows (in this order)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.valid.device)
        self.valid = self.valid.index_select(0, idx)
        for layer in self._layers():
            keys, values = _filled(layer)
            layer.keys = keys.index_select(0, idx)
            layer.values = values.index_select(0, idx)
        if not rows:
            self.cache = None
            self.valid = torch.zeros(0, 0, dtype=torch.bool, device=self.valid.device)
        self.trim_left()

    def trim_left(self) -> None:
        """Drop leading columns that are holes in every row."""
        if self.length == 0 or self.batch_size == 0:
            return
        any_valid = self.valid.any(dim=0)
        if bool(any_valid.all()):
            return
        nz = torch.nonzero(any_valid)
        first = int(nz[0]) if nz.numel() else self.length
        if first == 0:
            return
        self.valid = self.valid[:, first:]
        for layer in self._layers():
            keys, values = _filled(layer)
            layer.keys = keys[:, :, first:]
            layer.values = values[:, :, first:]

    def compact(self) -> None:
        """Move each row's valid slots to the right end (order kept) and drop empty columns."""
        if self.length == 0 or self.batch_size == 0:
            return
        counts = self.valid.sum(dim=1)
        new_len = int(counts.max())
        # Stable sort puts holes (0) before valid slots (1), keeping each group's order.
        order = torch.sort(self.valid.int(), dim=1, stable=True).indices[:, self.length - new_len :]
        self.valid = self.valid.gather(1, order)
        for layer in self._layers():
            keys, values = _filled(layer)
            idx = order[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
            layer.keys = keys.gather(2, idx)
            idx_v = order[:, None, :, None].expand(-1, values.shape[1], -1, values.shape[-1])
            layer.values = values.gather(2, idx_v)

    def maybe_compact(self, min_holes: int = 16, fraction: float = 0.25) -> bool:
        if self.length == 0:
            return False
        worst = int(self.holes().min())  # columns we can drop = holes of the fullest row
        if worst >= max(min_holes, int(fraction * self.length)):
            self.compact()
            return True
        return False

    def append_rows(self, other: BatchKV) -> None:
        """Add other's rows at the end of the batch, left-padding the shorter side with holes."""
        if other.batch_size == 0:
            return
        if self.batch_size == 0:
            self.cache, self.valid = other.cache, other.valid
            return
        length = max(self.length, other.length)
        self._pad_left(length)
        other._pad_left(length)
        self.valid = torch.cat([self.valid, other.valid], dim=0)
        mine, theirs = self._layers(), other._layers()
        if len(mine) != len(theirs) or not mine:
            raise RuntimeError(
                "both caches must hold at least one slot (prefill pads empty prompts with a hole)"
            )
        for a, b in zip(mine, theirs, strict=False):
            (a_keys, a_values), (b_keys, b_values) = _filled(a), _filled(b)
            a.keys = torch.cat([a_keys, b_keys], dim=0)
            a.values = torch.cat([a_values, b_values], dim=0)

    def row_slots(self, row: int, start: int, end: int) -> torch.Tensor:
        """Keys and values of one row's valid slots start..end, counted in the row's valid
        order (its tokens; holes skipped): (layers, 2, kv heads, end - start, head dim), a
        new tensor (the prefix cache's copy; prefix_cache.py)."""
        n = end - start
        cols = torch.nonzero(self.valid[row]).squeeze(1)[start:end]
        if cols.numel() != n or n <= 0:
            raise ValueError(f"row {row} has no valid slots {start}..{end}")
        first = int(cols[0])
        together = int(cols[-1]) - first == n - 1  # no holes between them: a slice
        parts: list[torch.Tensor] = []
        for layer in self._layers():
            keys, values = _filled(layer)
            if together:
                parts += [keys[row, :, first : first + n], values[row, :, first : first + n]]
            else:
                parts += [keys[row][:, cols], values[row][:, cols]]
        stacked = torch.stack(parts)
        return stacked.view(len(parts) // 2, 2, *stacked.shape[1:])

    @classmethod
    def from_slots(cls, device: torch.device | str, config: Any, slots: torch.Tensor) -> BatchKV:
        """A one-row cache holding these slots, all valid: slots (layers, 2, kv heads, n,
        head dim), as row_slots gives them (a prompt's cached prefix)."""
        kv = cls(device)
        cache = new_cache(config)
        for i in range(slots.shape[0]):
            cache.update(slots[i, 0].unsqueeze(0), slots[i, 1].unsqueeze(0), i)
        kv.cache = cache
        kv.valid = torch.ones(1, slots.shape[3], dtype=torch.bool, device=device)
        kv._layers()  # full attention only, as every BatchKV
        return kv

    def _pad_left(self, length: int) -> None:
        pad = length - self.length
        if pad <= 0:
            return
        self.valid = torch.cat(
            [
                torch.zeros(self.batch_size, pad, dtype=torch.bool, device=self.valid.device),
                self.valid,
            ],
            dim=1,
        )
        for layer in self._layers():
            k, v = _filled(layer)
            layer.keys = torch.cat([k.new_zeros(k.shape[0], k.shape[1], pad, k.shape[3]), k], dim=2)
            layer.values = torch.cat(
                [v.new_zeros(v.shape[0], v.shape[1], pad, v.shape[3]), v], dim=2
            )


def _filled(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache layer's keys and values (B, heads, L, d); every layer holds them once a
    forward has run."""
    if layer.keys is None or layer.values is None:
        raise RuntimeError("a KV-cache layer holds no keys/values yet")
    return layer.keys, layer.values


def decoder_stack(model: Any) -> Any:
    """A causal LM's decoder stack without its LM head: what `forward` runs (the draft's
    head is the compressed one, the target's is applied to the positions it needs)."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def forward(
    base: Any,
    kv: BatchKV,
    ids: torch.Tensor,
    pos: torch.Tensor,
    real: torch.Tensor,
    new_allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run a model's decoder stack over q new slots of every row against `kv`, which is
    updated in place; returns the last hidden states (B, q, d).

    ids, pos, real: (B, q) token ids, position ids, and which slots are real tokens (the
    rest become holes); new_allowed: (q, q) which new slots may see each other (causal
    by default).
    """
    out = _run(base, kv, ids, pos, real, new_allowed, {})
    return out.last_hidden_state


def fill_caches(
    base: Any, kv: BatchKV, ids: torch.Tensor, pos: torch.Tensor, real: torch.Tensor
) -> None:
    """`forward` for a prefill, whose hidden states nobody reads: only `kv` changes.

    Why: a stack that offers it (FILLS_CACHES_ONLY: the target's lean loop, the fused
    draft) then stops its last layer after that layer's keys and values, skipping its
    attention, o projection and MLP (~3% of a 28-layer target's prefill). The cache
    holds the same values either way; other stacks run their whole forward."""
    owner = getattr(base, "lean", base)  # the lean loop sits on the stack as `lean`
    extra = {"caches_only": True} if getattr(owner, "FILLS_CACHES_ONLY", False) else {}
    _run(base, kv, ids, pos, real, None, extra)


def _run(
    base: Any,
    kv: BatchKV,
    ids: torch.Tensor,
    pos: torch.Tensor,
    real: torch.Tensor,
    new_allowed: torch.Tensor | None,
    extra: dict[str, Any],
) -> Any:
    dtype = base.get_input_embeddings().weight.dtype
    mask = kv.mask_for(real, dtype, new_allowed)
    cache = kv.cache if kv.cache is not None else new_cache(base.config)
    out = base(
        input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True, **extra
    )
    kv.after_forward(cache, real)
    return out
