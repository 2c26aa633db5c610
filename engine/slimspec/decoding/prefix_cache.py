"""A prefix cache for the target's and the draft's KV: a prompt that starts like an
earlier one (a system prompt, the earlier turns of a chat) skips that part's prefill.

Block-granular, as vLLM's automatic prefix caching and SGLang's radix cache: a prompt's
prefix is cut into blocks of `block_tokens` tokens, and a block is keyed by its parent
block and its own tokens, so a block is found only behind the very same tokens before
it (the keys are the tokens themselves, not a hash of them: no collisions). A block
holds both models' keys and values for its tokens, every layer, as one tensor per model
((layers, 2, kv heads, block_tokens, head dim)), copied out of the caches they were
computed in, so nothing done to a batch's caches later can change them (the target's
alone where the draft prefills only a window of each prompt, draft_context.py). Keys carry
RoPE at absolute positions; a shared prefix sits at the same positions in every prompt
that has it, so the stored keys are reused as they are.

Bounded in bytes, least recently used evicted first. A lookup or store touches its
blocks from the last to the first, so a block is always more recent than its
descendants and the least recent block is a leaf: eviction never strands a block
behind a missing parent. All methods take the cache's lock (lookups and stores run on
the step thread; stats and clear may come from any thread).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

BLOCK_TOKENS = 16
MIB = 1 << 20
DEFAULT_MB = 256.0  # the setting's default (docs/engine.md says why)
ENV = "SLIMSPEC_PREFIX_CACHE_MB"

Key = tuple[int, tuple[int, ...]]  # (parent block's id, 0 for none; the block's tokens)
# extract(start, end) -> (target, draft): both models' slots start..end of the prompt,
# (layers, 2, kv heads, end - start, head dim) each; draft None where the draft's cache
# holds only a window of the prompt (draft_context.py)
Extract = Callable[[int, int], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class _Block:
    id: int
    key: Key
    parent: _Block | None
    target: torch.Tensor
    draft: torch.Tensor | None
    children: int = 0

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.target) + tensor_bytes(self.draft)


@dataclass(frozen=True)
class PrefixHit:
    """The longest stored prefix of a prompt: its length in tokens and both models' keys
    and values for it, (layers, 2, kv heads, tokens, head dim); None when nothing hit
    (the draft's also where a block of it was stored without the draft's)."""

    tokens: int = 0
    target: torch.Tensor | None = None
    draft: torch.Tensor | None = None


@dataclass(frozen=True)
class PrefixCacheStats:
    lookups: int = 0  # prompts looked up
    hits: int = 0  # of them, prompts that found at least one block
    lookup_tokens: int = 0  # tokens looked up (each prompt's cacheable part)
    hit_tokens: int = 0  # tokens whose prefill was skipped
    stored_tokens: int = 0  # tokens stored (new blocks)
    evictions: int = 0  # blocks evicted
    blocks: int = 0  # blocks held now
    bytes: int = 0  # bytes held now
    max_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def mb_to_bytes(mb: float) -> int:
    """A size in MiB (the setting's unit) as bytes; ValueError below 0."""
    if not mb >= 0:
        raise ValueError(f"the prefix cache size must be >= 0 MiB, got {mb}")
    return int(mb * MIB)


def resolve_mb(mb: float | None, env: Mapping[str, str]) -> float:
    """The prefix cache's size in MiB: as given, else $SLIMSPEC_PREFIX_CACHE_MB, else the
    default; 0 turns it off. ValueError for a negative or unreadable size."""
    if mb is None:
        raw = env.get(ENV, "").strip()
        if not raw:
            return DEFAULT_MB
        try:
            mb = float(raw)
        except ValueError:
            raise ValueError(f"{ENV} must be a number of MiB, got {raw!r}") from None
    mb_to_bytes(mb)
    return float(mb)


def full_blocks(n_tokens: int, block_tokens: int) -> int:
    return n_tokens // block_tokens


def blocks_that_fit(max_bytes: int, block_bytes: int, held_on_path: int, new: int) -> int:
    """How many of `new` blocks of `block_bytes` to store behind `held_on_path` blocks of
    the same prompt, so the prompt's whole path fits in max_bytes (other prompts' blocks
    are evicted to make room; a path that does not fit keeps its first blocks)."""
    if block_bytes <= 0:
        return new
    return max(0, min(new, max_bytes // block_bytes - held_on_path))


class PrefixCache:
    """Both models' KV for blocks of earlier prompts, keyed by token prefix (module doc)."""

    def __init__(self, max_bytes: int, block_tokens: int = BLOCK_TOKENS) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.max_bytes = max_bytes
        self.block_tokens = block_tokens
        self._blocks: OrderedDict[Key, _Block] = OrderedDict()  # least recent first
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._bytes = 0
        self._lookups = self._hits = self._lookup_tokens = self._hit_tokens = 0
        self._stored_tokens = self._evictions = 0

    # ----------------------------------------------------------------- reading
    def lookup(self, tokens: Sequence[int]) -> PrefixHit:
        """The longest run of stored blocks at the start of `tokens` (a prompt's part that
        its target cache would hold: prompt[:-1]); marks them recently used."""
        with self._lock:
            path = self._walk(tokens)
            self._touch(path)
            self._lookups += 1
            self._lookup_tokens += len(tokens)
            if not path:
                return PrefixHit()
            n = len(path) * self.block_tokens
            self._hits += 1
            self._hit_tokens += n
            target = [b.target for b in path]
            drafts = [b.draft for b in path]
        # stored blocks are never written to, so they are read outside the lock
        draft = None
        if all(d is not None for d in drafts):
            draft = torch.cat([d for d in drafts if d is not None], dim=3)
        return PrefixHit(n, torch.cat(target, dim=3), draft)

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            return PrefixCacheStats(
                self._lookups,
                self._hits,
                self._lookup_tokens,
                self._hit_tokens,
                self._stored_tokens,
                self._evictions,
                len(self._blocks),
                self._bytes,
                self.max_bytes,
            )

    # ----------------------------------------------------------------- writing
    def store(self, tokens: Sequence[int], extract: Extract) -> int:
        """Store the full blocks of `tokens` not stored yet; extract(start, end) gives both
        models' keys and values for tokens[start:end] (the draft's may be None). Returns
        the tokens stored."""
        bt = self.block_tokens
        n_full = full_blocks(len(tokens), bt)
        if n_full == 0 or self.max_bytes <= 0:
            return 0
        with self._lock:
            path = self._walk(tokens)
            have = len(path)
            if have < n_full:
                target, draft = extract(have * bt, n_full * bt)
                block_bytes = (tensor_bytes(target) + tensor_bytes(draft)) // (n_full - have)
                new = blocks_that_fit(self.max_bytes, block_bytes, have, n_full - have)
                parent = path[-1] if path else None
                for i in range(new):
                    cols = slice(i * bt, (i + 1) * bt)
                    start = (have + i) * bt
                    block = _Block(
                        next(self._ids),
                        (parent.id if parent else 0, tuple(tokens[start : start + bt])),
                        parent,
                        target[:, :, :, cols].clone(memory_format=torch.contiguous_format),
                        None
                        if draft is None
                        else draft[:, :, :, cols].clone(memory_format=torch.contiguous_format),
                    )
                    self._blocks[block.key] = block
                    self._bytes += block.nbytes
                    if parent is not None:
                        parent.children += 1
                    path.append(block)
                    parent = block
                self._stored_tokens += new * bt
                stored = new * bt
            else:
                stored = 0
            self._touch(path)
            self._evict(protect=set(map(id, path)))
            return stored

    def clear(self) -> None:
        """Drop every block (the counters stay: they are totals over the cache's life)."""
        with self._lock:
            self._blocks.clear()
            self._bytes = 0

    # ----------------------------------------------------------------- inside the lock
    def _walk(self, tokens: Sequence[int]) -> list[_Block]:
        bt, path = self.block_tokens, []
        parent = 0
        for i in range(full_blocks(len(tokens), bt)):
            block = self._blocks.get((parent, tuple(tokens[i * bt : (i + 1) * bt])))
            if block is None:
                break
            path.append(block)
            parent = block.id
        return path

    def _touch(self, path: list[_Block]) -> None:
        for block in reversed(path):  # parents end up more recent than their children
            self._blocks.move_to_end(block.key)

    def _evict(self, protect: set[int]) -> None:
        """Least recently used leaves first, until the bytes fit; blocks of the prompt
        just stored go last (only when the cache cannot hold anything else)."""
        while self._bytes > self.max_bytes and self._blocks:
            victim = next(
                (b for b in self._blocks.values() if b.children == 0 and id(b) not in protect),
                None,
            )
            if victim is None:
                victim = next(b for b in self._blocks.values() if b.children == 0)
            del self._blocks[victim.key]
            self._bytes -= victim.nbytes
            if victim.parent is not None:
                victim.parent.children -= 1
            self._evictions += 1
