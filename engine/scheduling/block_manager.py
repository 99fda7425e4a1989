"""Paged KV bookkeeping: a fixed pool of blocks, ref counts, and a prefix cache.

Only ids and counts live here; the K/V tensors belong to the model runner,
which writes token `pos` of a sequence at slot
`block_table[pos // block_size] * block_size + pos % block_size`.

Prefix cache: a full, computed block is registered under the chain hash
`h_i = blake2b(h_{i-1}, tokens of block i)`, so a hit on block i implies the
whole prefix up to block i matches (the block also keeps its tokens, checked on
every hit). The chain starts from the sequence's LoRA adapter (`root_hash`): the same
tokens under another adapter are other K/V. A partially filled block is never
shared. A freed block that holds a hash stays cached (its K/V intact) and is
evicted least-recently-freed first, only when a fresh block is needed and no
never-cached block is free.

Sliding window: when every layer of the model attends only to the last `window`
positions, a block wholly before the window of a sequence's next token is never
read again; `release_passed` gives it back (cached ones stay in the prefix cache,
like any freed block) and marks its table entry RELEASED. A model with any
full-attention layer keeps every block (no window is given).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from batchd.engine.scheduling.sequence import Sequence

_ROOT_HASH = 0
# A block-table entry whose block went back to the pool (outside the sliding window).
RELEASED = -1


def chain_hash(parent: int, tokens: list[int]) -> int:
    """Hash of a full block given its parent block's hash (stable across processes)."""
    digest = hashlib.blake2b(parent.to_bytes(16, "little"), digest_size=16)
    digest.update(array("q", tokens).tobytes())
    return int.from_bytes(digest.digest(), "little")


def root_hash(adapter: str | None) -> int:
    """The parent of a sequence's first block: its adapter's own root, so blocks computed
    with different adapters (or none) never match."""
    if adapter is None:
        return _ROOT_HASH
    return int.from_bytes(hashlib.blake2b(adapter.encode(), digest_size=16).digest(), "little")


@dataclass(slots=True)
class Block:
    """One pool block. `hash` is set while the block is registered in the prefix cache."""

    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    """Allocates pool blocks to sequences' block tables; shares cached full prefix blocks.

    Every block is in exactly one state: used (ref_count > 0), free (ref 0, no
    hash) or evictable (ref 0, cached). `num_free_blocks` counts both of the
    last two: a cached free block is reclaimed when a fresh block is needed.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        window: int | None = None,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        if window is not None and window < 1:
            raise ValueError(f"window={window} must be >= 1 (or None: full attention)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.num_window_releases = 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest-freed first
        self._cache: dict[int, int] = {}  # chain hash -> block id
        self.num_evictions = 0
        self.hit_tokens = 0
        self.query_tokens = 0

    # -- figures ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a fresh allocation can take (never-cached free plus evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or evictable."""
        return len(self._cache)

    @property
    def hit_rate(self) -> float:
        """Prefix-cache tokens reused / tokens looked up at admissions (0 before any)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Fresh blocks `seq` needs so that its table covers positions [0, num_tokens)."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, num_fresh: int, *, reuse: list[int]) -> bool:
        """Whether `num_fresh` new blocks fit after taking the cached blocks in `reuse`."""
        reclaimed = sum(1 for b in reuse if self.blocks[b].ref_count == 0)
        return num_fresh + reclaimed <= self.num_free_blocks

    # -- prefix cache ----------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding `seq`'s leading full blocks, in order.

        At most the full blocks before the last token: a hit never covers the
        whole sequence, so at least one token is computed and sampled from.
        Nothing for a sequence that wants its prompt's logprobs and has no output
        yet: every prompt position must then be computed.
        """
        if not self.enable_prefix_caching:
            return []
        if seq.params.prompt_logprobs and not seq.num_output_tokens:
            return []
        hits: list[int] = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self._cache.get(self._block_hash(seq, i))
            if block_id is None or self.blocks[block_id].token_ids != tuple(self._tokens(seq, i)):
                break
            hits.append(block_id)
        return hits

    def register_full_blocks(self, seq: Sequence, *, start: int) -> None:
        """Cache `seq`'s blocks that became full and computed since position `start`.

        A block whose content is already cached under another block stays
        private (the first copy serves later hits).
        """
        if not self.enable_prefix_caching:
            return
        for i in range(start // self.block_size, seq.num_computed_tokens // self.block_size):
            assert seq.block_table[i] != RELEASED, f"{seq.seq_id}: block {i} released"
            block = self.blocks[seq.block_table[i]]
            digest = self._block_hash(seq, i)
            assert block.hash is None, f"block {block.block_id} of {seq.seq_id} cached twice"
            if digest not in self._cache:
                block.hash = digest
                block.token_ids = tuple(self._tokens(seq, i))
                self._cache[digest] = block.block_id

    def _tokens(self, seq: Sequence, index: int) -> list[int]:
        return seq.tokens(index * self.block_size, (index + 1) * self.block_size)

    def _block_hash(self, seq: Sequence, index: int) -> int:
        hashes = seq.block_hashes
        while len(hashes) <= index:
            parent = hashes[-1] if hashes else root_hash(seq.adapter)
            hashes.append(chain_hash(parent, self._tokens(seq, len(hashes))))
        return hashes[index]

    # -- allocation ------------------------------------------------------------------------

    def admit(self, seq: Sequence, cached: list[int]) -> None:
        """Start `seq`'s block table with the prefix-cache hits `cached` (from match_prefix).

        Sets num_computed_tokens and num_cached_tokens past the shared blocks
        and counts the lookup in the hit-rate figures.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0, f"{seq} already has blocks"
        for block_id in cached:
            self._ref(block_id)
        seq.block_table = list(cached)
        seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * self.block_size
        self.hit_tokens += seq.num_cached_tokens
        self.query_tokens += seq.num_tokens

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Append fresh blocks so `seq`'s table covers positions [0, num_tokens)."""
        needed = self.num_new_blocks(seq, num_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(
                f"{seq.seq_id}: needs {needed} blocks, {self.num_free_blocks} free (check first)"
            )
        for _ in range(needed):
            seq.block_table.append(self._take_fresh())

    def free(self, seq: Sequence) -> None:
        """Give back all of `seq`'s blocks; cached ones stay in the prefix cache.

        Released last block first, so a sequence's tail is evicted before its
        (more shareable) head.
        """
        for block_id in reversed(seq.block_table):
            if block_id != RELEASED:
                self._unref(block_id)
        seq.block_table = []

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back `seq`'s blocks past those covering positions [0, num_tokens) (a
        rolled-back speculative tail: never cached, since only computed blocks are)."""
        keep = self.blocks_for(num_tokens)
        table = seq.block_table
        while len(table) > keep:
            block_id = table.pop()
            if block_id != RELEASED:
                self._unref(block_id)

    def release_passed(self, seq: Sequence) -> None:
        """Give back `seq`'s blocks wholly before the window of its next token (position
        num_computed_tokens sees positions > num_computed_tokens - window); nothing
        without a window. Released entries form a prefix of the table, released once."""
        if self.window is None:
            return
        passed = (seq.num_computed_tokens - self.window + 1) // self.block_size
        table = seq.block_table
        for i in range(min(passed, len(table)) - 1, -1, -1):
            if table[i] == RELEASED:
                break
            self._unref(table[i])
            table[i] = RELEASED
            self.num_window_releases += 1

    def _take_fresh(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            block = self.blocks[block_id]
            assert block.hash is not None and self._cache[block.hash] == block_id
            del self._cache[block.hash]
            block.hash, block.token_ids = None, ()
            self.num_evictions += 1
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"block {block_id} handed out while in use"
        block.ref_count = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.hash is not None, f"block {block_id} shared without being cached"
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is None:
                self._free.append(block_id)
            else:
                self._evictable[block_id] = None

    def check_invariants(self) -> None:
        """Assert the pool's internal consistency (O(num_blocks); for tests and debugging)."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is twice on the free list"
        assert not free & evictable, "a block is both free and evictable"
        for block in self.blocks:
            in_pool = block.block_id in free or block.block_id in evictable
            assert (block.ref_count == 0) == in_pool, f"{block} ref count disagrees with lists"
            assert block.ref_count >= 0
            assert (block.block_id in evictable) <= (block.hash is not None)
            assert (block.block_id in free) <= (block.hash is None)
            if block.hash is not None:
                assert self._cache.get(block.hash) == block.block_id, f"{block} not in cache"
                assert len(block.token_ids) == self.block_size
        assert len(self._cache) == sum(b.hash is not None for b in self.blocks)
