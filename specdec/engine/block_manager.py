"""Accounting of the paged KV cache's blocks, with automatic prefix caching; owns no tensors.

Each sequence has a block table: the ids of the blocks holding its tokens' K/V, in
order; token t lives in block `block_table[t // block_size]` at offset
`t % block_size`. Check/act pairs: `can_allocate` before `allocate`.

Prefix caching (vLLM v1's design, our code):
- A *full* block of a sequence is identified by a hash of its parent block's hash and its
  own token ids (`block_hashes`). The KV of a block depends on nothing else here: one
  model, no LoRA, no multimodal inputs. The first block's hash also covers the request's
  cache salt (vLLM's `cache_salt`), so every later block does too: requests with different
  salts never share a block, and a prompt's cache hits tell a client only about prompts
  sent with its own salt.
- Only blocks whose every token is verified and computed are registered
  (`cache_full_blocks`, called with `num_computed_tokens`, which counts verified tokens
  only): a draft's KV sits past that count, so rollback, preemption and chunked prefill
  never expose it to another request.
- Blocks are reference counted. A block nobody holds goes to the free queue; a cached one
  keeps its hash there and is reused by any later request with the same prefix
  (`lookup`, `take_prefix`) until the pool needs it: allocation takes free blocks from the
  front of the queue (uncached ones, then cached ones least recently freed first) and
  forgets the hash of a cached block it takes (eviction).
- A sequence only ever writes K/V at positions >= its `num_computed_tokens`, and a cache
  hit covers whole blocks before that count, so a cached block is never written again.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from specdec.engine.sequence import Sequence

_ROOT_HASH = b"specdec-prefix-root"


def block_hash(parent_hash: bytes | None, token_ids: list[int], cache_salt: str = "") -> bytes:
    """A full block's identity: sha256 of its parent's hash and its token ids; a first
    block (no parent) also hashes the cache salt, which its descendants inherit."""
    digest = hashlib.sha256(parent_hash or _ROOT_HASH)
    if parent_hash is None and cache_salt:
        salt = cache_salt.encode()
        digest.update(len(salt).to_bytes(8, "little") + salt)
    digest.update(array("I", token_ids).tobytes())
    return digest.digest()


def extend_block_hashes(seq: Sequence, block_size: int) -> list[bytes]:
    """The hashes of `seq`'s full blocks (of its current tokens), extended incrementally."""
    hashes = seq.block_hashes
    tokens = seq.token_ids
    while (len(hashes) + 1) * block_size <= len(tokens):
        start = len(hashes) * block_size
        hashes.append(block_hash(hashes[-1] if hashes else None, tokens[start:start + block_size],
                                 seq.cache_salt))
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *,
                 enable_prefix_caching: bool = False) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # hash -> block id
        # Blocks nobody holds, in eviction order (front first); values unused.
        self._free: OrderedDict[int, None] = OrderedDict((block_id, None)
                                                         for block_id in range(num_blocks))
        # vLLM's prefix-cache counters, in tokens: asked for (`lookup`s taken) and found.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_evicted_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free ones, cached or not."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._hash_of[block_id] is not None

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still needs so that its table covers `num_tokens` slots."""
        return max(0, self.num_blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grows `seq`'s block table to cover `num_tokens` slots."""
        missing = self.num_missing_blocks(seq, num_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"allocate: need {missing} blocks, {self.num_free_blocks} free")
        for _ in range(missing):
            block_id, _ = self._free.popitem(last=False)
            old_hash = self._hash_of[block_id]
            if old_hash is not None:  # evict: the pool needs it for new tokens
                del self._cached[old_hash]
                self._hash_of[block_id] = None
                self.num_evicted_blocks += 1
            self._ref_counts[block_id] = 1
            seq.block_table.append(block_id)

    # ------------------------------------------------------------ prefix caching

    def lookup(self, seq: Sequence) -> list[int]:
        """The cached blocks holding the longest prefix of `seq`'s tokens, without taking
        them. At least the last token is left out, so that its forward (and the block it
        writes) is still to come."""
        if not self.enable_prefix_caching:
            return []
        hashes = extend_block_hashes(seq, self.block_size)
        hits: list[int] = []
        for digest in hashes[:self._max_hit_blocks(seq)]:
            block_id = self._cached.get(digest)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _max_hit_blocks(self, seq: Sequence) -> int:
        """Blocks of `seq` a hit may cover: those before the block of its last token."""
        return (seq.num_tokens - 1) // self.block_size

    def next_block_hash(self, seq: Sequence, num_hit_blocks: int) -> bytes | None:
        """The hash of the block after `seq`'s `num_hit_blocks` hits (from `lookup`), when a
        hit could still cover it; None otherwise."""
        if num_hit_blocks >= self._max_hit_blocks(seq):
            return None
        return extend_block_hashes(seq, self.block_size)[num_hit_blocks]

    def num_free_after_taking(self, hits: list[int]) -> int:
        """Free blocks left once `hits` are taken (unheld cached blocks sit in the queue)."""
        return self.num_free_blocks - sum(1 for block_id in hits if self._ref_counts[block_id] == 0)

    def take_prefix(self, seq: Sequence, hits: list[int]) -> int:
        """Starts an empty `seq` on the cached blocks `hits` (from `lookup`); returns the
        tokens they hold, now counted as computed. Counts the query and its hits."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if self.enable_prefix_caching:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += len(hits) * self.block_size
        for block_id in hits:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(hits) * self.block_size
        return seq.num_computed_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Registers `seq`'s blocks that are full of computed (verified) tokens. A block whose
        content another block already caches stays unregistered (freed like any other).

        A step that verified drafts past a stop (EOS, a stop token, max_tokens) has computed
        more positions than the sequence keeps: only the kept tokens' blocks count."""
        if not self.enable_prefix_caching:
            return
        num_full = min(min(seq.num_computed_tokens, seq.num_tokens) // self.block_size,
                       len(seq.block_table))
        if num_full <= seq.num_registered_blocks:
            return
        hashes = extend_block_hashes(seq, self.block_size)
        for index in range(seq.num_registered_blocks, num_full):
            block_id = seq.block_table[index]
            digest = hashes[index]
            if self._hash_of[block_id] is None and digest not in self._cached:
                self._cached[digest] = block_id
                self._hash_of[block_id] = digest
        seq.num_registered_blocks = num_full

    def pending_hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of the full prompt blocks `seq` is still computing (for the scheduler,
        which holds back a request about to compute the same blocks)."""
        if not self.enable_prefix_caching:
            return []
        hashes = extend_block_hashes(seq, self.block_size)
        return hashes[seq.num_computed_tokens // self.block_size:seq.prompt_len // self.block_size]

    # ------------------------------------------------------------ release

    def _release(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        assert self._ref_counts[block_id] >= 0, f"block {block_id} freed twice"
        if self._ref_counts[block_id] == 0:
            self._free[block_id] = None  # cached: the back, evicted last
            if self._hash_of[block_id] is None:
                self._free.move_to_end(block_id, last=False)  # reused first

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Returns the blocks past the first `num_tokens` slots to the pool (rollback)."""
        keep = self.num_blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        # The tail first: of a sequence's cached blocks, its last ones are evicted first.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table.clear()
        if self.enable_prefix_caching:  # a drafter's sequences have no such count
            seq.num_registered_blocks = 0

    def check_consistency(self, sequences: list[Sequence]) -> None:
        """Asserts the accounting holds for `sequences`, every sequence holding blocks: each
        block is held exactly as often as block tables name it, free exactly when held by
        none, and the hash index and the blocks agree (tests, and debugging)."""
        held = [0] * self.num_blocks
        for seq in sequences:
            for block_id in seq.block_table:
                held[block_id] += 1
        assert held == self._ref_counts, "reference counts disagree with the block tables"
        for block_id in range(self.num_blocks):
            assert (block_id in self._free) == (held[block_id] == 0), f"block {block_id}"
        assert len(self._cached) == sum(digest is not None for digest in self._hash_of)
        for digest, block_id in self._cached.items():
            assert self._hash_of[block_id] == digest

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
