"""Every layer's K/V in DRAM, head-major like the device pages, with per-block side tables:
mean, max and min keys (Quest) and, for DYNAMIC and FIX anchors, the keys each block is
represented by.
With kv_type q8_0 or q4_0 each of K and V is two planes: GGML's values and their float16 scales
(operators/kv_quant.py); the side tables always come from the unquantised keys. A cache may hold
its leading blocks in one copy with other caches (`share`, ktlong/kv/shared_prefix.py).

Tables are laid out for max_seq_len but hold memory only as a conversation needs it: each global
table's kv-head ranges grow (`reserve`: committed and page-locked, in whole pages) before a
prefill, a load or a decode step writes past them, so an empty cache costs next to nothing and a
128K conversation under a max_seq_len of 1M holds its 128K."""

from __future__ import annotations

import math
from typing import Callable

import torch

from ktlong.kv.host_memory import mapped_empty
from ktlong.kv.layout import KVLayout
from ktlong.kv.pinned import HUGE_PAGE, PinnedTensors, advise_huge_pages
from ktlong.kv.shared_prefix import SharedPrefix, map_private, shared_prefix_bytes
from operators.kv_quant import dequantize_kv


def growth_step(layout: KVLayout) -> int:
    """The blocks a cache grows by a multiple of: whole pages of every table's kv-head range, and
    whole 2 MiB pages of K's and V's (where Linux gives them huge pages, a range that ended inside
    one would hold all of it: 2 MiB a range, 512 ranges at 8B shapes)."""
    kv = layout.table_block_bytes()[0]
    return math.lcm(layout.page_blocks(), HUGE_PAGE // math.gcd(HUGE_PAGE, kv))


# the least a cache grows by (reserve): an answer's first 2,048 tokens after a prompt, at block 128
GROWTH_BLOCKS = 16
# the most one growth adds a table (32K tokens at block 128): a decoding conversation's piece is
# zeroed and page-locked inside a step of the batch, so a piece is a short pause for the others
# (a layer of 8B shapes at q8_0: 70 MB)
GROWTH_MAX_BLOCKS = 256
# the most one page-locking call takes of a table (a kv head's range is locked in pieces of this
# or one growth step): while CUDA locks a range, the other threads' calls into it wait. Locked a
# head at a time (134 MB a head at 1M tokens, 8B shapes, q8_0), 40 of a 1M prefill's chunks
# waited 94-164 ms for its layers' helper (H200, .gpu_scripts/chunk_prof.py, session 46)
PIN_PIECE_BYTES = 16 << 20


def reserved_blocks(layout: KVLayout, tokens: int, held: int = 0, ahead: int | None = None) -> int:
    """The blocks a cache's table holds once it reserves `tokens` (HostKVCache.reserve) from
    `held`: the tokens and GROWTH_BLOCKS past them, or an eighth more than it held
    (GROWTH_MAX_BLOCKS at most), whichever is more, so that a conversation that keeps growing
    grows in few pieces; no further than `ahead` tokens (what the caller will write in all, a
    prefill's prompt) and GROWTH_BLOCKS; in whole pages (growth_step), within the capacity."""
    blocks = -(-tokens // layout.block_size)
    target = max(blocks + GROWTH_BLOCKS, held + min(held // 8, GROWTH_MAX_BLOCKS))
    if ahead is not None:
        target = min(target, -(-ahead // layout.block_size) + GROWTH_BLOCKS)
    step = growth_step(layout)
    return min(layout.num_blocks, -(-target // step) * step)


def cache_bytes_for(layout: KVLayout, tokens: int) -> int:
    """DRAM a new cache holds for a conversation of `tokens` tokens."""
    return layout.dram_kv_bytes(sliding=True) + shared_prefix_bytes(layout, reserved_blocks(layout, tokens))


class HostKVCache:
    """Every layer's K/V and side tables in DRAM (pinned when a GPU will copy into it), each
table on its own mapping (ktlong/kv/host_memory.py), which a saved cache's file can be mapped
into when the tables are not pinned (maps_files).

    k[layer], v[layer]: [KV, blocks, B, R] of layout.stored_dtype, R values per row (D, or D/2
    for q4_0); k_scales[layer], v_scales[layer]: int16 [KV, blocks, B, D/32] float16 words for
    q8_0 / q4_0, [KV, blocks, B, 0] otherwise. Block 0 is absolute block first_block[layer] (0 for
    global layers; the start of the kept tail for sliding layers). Side tables are per layer,
    [KV, NB, D], and anchor_keys [KV, NB, A, D] (A = layout.anchor_keys); empty for sliding layers.

    K and V ask for huge pages only where the CPU reads them (not pinned): the CPU's scattered
    block reads miss its TLB on small pages, where the GPU's reads over PCIe do not go through it.
    And asked for, a huge page may make a fault wait for Linux to compact memory once DRAM is
    nearly full: a 1M prompt's prefill beside four decoding streams on an H200 took 234 s in a
    run with 54,313 compaction stalls, 108 s in the next with none, both asking (the second was
    meant not to: docs/measurements/2026-12-01-serving.md); a small page never waits for that.
    """

    def __init__(self, layout: KVLayout, pin: bool, prefix: tuple["HostKVCache", int] | None = None):
        """prefix: (source, blocks): made holding source's first blocks as its tokens, as share()
        would, without ever committing memory of its own under them."""
        H, B, D = layout.num_kv_heads, layout.block_size, layout.head_dim
        self._pinned = PinnedTensors(pin)

        def alloc(shape, dtype, huge=False):
            t = mapped_empty(shape, dtype)
            if huge and not pin:  # before the first touch, which zero_ is: K/V, whose blocks decode reads scattered
                advise_huge_pages(t)
            return t

        self.layout = layout
        self.maps_files = not pin
        blocks = [layout.blocks_in_dram(i) for i in range(layout.num_layers)]
        tables = [0 if layout.is_sliding(i) else layout.num_blocks for i in range(layout.num_layers)]
        row, groups = layout.stored_row
        self.k = [alloc((H, n, B, row), layout.stored_dtype, huge=True) for n in blocks]
        self.v = [alloc((H, n, B, row), layout.stored_dtype, huge=True) for n in blocks]
        self.k_scales = [alloc((H, n, B, groups), torch.int16) for n in blocks]
        self.v_scales = [alloc((H, n, B, groups), torch.int16) for n in blocks]
        self.key_mean = [alloc((H, n, D), torch.float32) for n in tables]
        self.key_max = [alloc((H, n, D), torch.float32) for n in tables]
        self.key_min = [alloc((H, n, D), torch.float32) for n in tables]
        self.anchor_keys = [alloc((H, n, layout.anchor_keys, D), torch.float32) for n in tables]
        self.first_block = [0] * layout.num_layers
        self.num_tokens = 0  # tokens held; changed only by advance(), truncate(), reset() and share()
        self.shared: SharedPrefix | None = None  # the leading blocks held in one copy with other caches
        self.shared_blocks = 0  # how many of them (at most shared.blocks)
        # (source, end block): the blocks past the shared ones that reserve copies from source's
        # (share), until every global layer has committed them
        self._copying: tuple[HostKVCache, int] | None = None
        # per global layer, the leading blocks of its tables that hold memory (page-locked where
        # pinned): `reserve` grows them before anything is written past them
        self.committed = {i: 0 for i in layout.global_layers}
        for kind in self._kinds():  # a sliding layer's tail is small: all of it now
            for i in range(layout.num_layers):
                if layout.is_sliding(i) and kind[i].numel():
                    kind[i].zero_()
                    self._pinned.pin(kind[i])
        if prefix is not None:
            self.share(*prefix)

    def _kinds(self) -> tuple[list[torch.Tensor], ...]:
        """Each kind of table, per layer, in the order of KVLayout.table_block_bytes."""
        return (self.k, self.v, self.k_scales, self.v_scales, self.key_mean, self.key_max, self.key_min,
                self.anchor_keys)

    def shared_tables(self) -> list[torch.Tensor]:
        """The tables a shared prefix covers: every non-empty one of every global layer."""
        return [kind[i] for i in self.layout.global_layers for kind in self._kinds() if kind[i].numel()]

    def share(self, source: "HostKVCache", blocks: int, tokens: int | None = None):
        """Hold source's first `tokens` tokens (its first `blocks` blocks by default): of them,
        the first `blocks` blocks (a multiple of shared_prefix.granularity, or 0) in one copy in
        DRAM for both, and the blocks past them copies of source's, made as `reserve` commits
        them (the tokens that a follow-up's prefill would recompute otherwise: 2,034 of a
        6,130-token document took 24 s on two cores). This cache is empty, and holds them as its
        tokens now; nothing may read it before it reserves them. Where source does not hold
        that many shared already, its own bytes become the shared copy first (its private pages
        there freed). No device work may read either cache meanwhile; source's rows before
        `tokens` stay as they are until this cache reserved them (a conversation only grows)."""
        tokens = blocks * self.layout.block_size if tokens is None else tokens
        assert self.num_tokens == 0 and source is not self and source.layout == self.layout and not self.layout.sliding
        assert blocks * self.layout.block_size <= tokens <= source.num_tokens and tokens > 0
        if blocks and source.shared_blocks < blocks:  # its bytes become the shared copy, mapped back in place
            with source._pinned.released():
                source.shared, source.shared_blocks = SharedPrefix(source.shared_tables(), blocks), blocks
        if blocks:
            self._hold(source.shared, blocks)
        if tokens > blocks * self.layout.block_size:
            self._copying = (source, -(-tokens // self.layout.block_size))
        self.num_tokens = tokens

    @property
    def copying(self) -> bool:
        """Whether blocks that share() copies from its source wait for `reserve`."""
        return self._copying is not None

    def _hold(self, prefix: SharedPrefix, blocks: int):
        """The files' pages under this cache's leading blocks, mapped now and page-locked where
        it is reserved next (`reserve`, which never zeroes them): the prefill that follows, a
        piece at a time (LongContextSession.prefill), or a decode step. Locked here, the 9 GiB
        of a 128K document at 8B shapes (2.4 M small pages) took 1.4-2.0 s of the server's
        thread at each join, every stream waiting."""
        # marked first: a remap that fails half-way leaves ranges of the files under this cache,
        # which reset() then maps private again before anything is written there
        self.shared, self.shared_blocks = prefix, blocks
        with self._pinned.released():
            prefix.map_over(self.shared_tables(), blocks)

    def reserve(self, tokens: int, layers: list[int] | None = None, ahead: int | None = None,
                pace: Callable[[], None] = lambda: None):
        """Memory for the first `tokens` tokens of the global layers' tables (all, or `layers`),
        held (and page-locked where pinned) now, with room to grow past them (reserved_blocks;
        ahead: the tokens the caller will write in all). A prefill's layers are reserved whole,
        a layer ahead of it on a helper thread (ktlong/kv/commit_ahead.py); a decoding
        conversation a layer a step, ahead of its tokens (grow_ahead). Anything written past the
        reserved tokens would land in memory the GPU cannot read. pace(): after each piece is locked (_grow)."""
        assert tokens <= self.layout.capacity, "the KV cache is full; raise max_seq_len"
        blocks = -(-tokens // self.layout.block_size)
        for layer in self.committed if layers is None else layers:
            held = self.committed[layer]
            if blocks > held:
                self._grow(layer, reserved_blocks(self.layout, tokens, held, ahead), pace)

    def grow_ahead(self, tokens: int):
        """A decoding conversation's next growth, a layer at a time: the first global layer whose
        tables hold fewer than `tokens` tokens and a lookahead of a token per global layer and a
        block grows as reserve grows it. Called every step with the step's tokens, it grows each
        layer before reserve would have to grow them all in one step (at 8B shapes, q8_0, a 60K
        conversation's growth is 534 MB of every layer's tables, zeroed and page-locked; a layer's
        is 17 MB)."""
        ahead = min(tokens + len(self.committed) + self.layout.block_size, self.layout.capacity)
        blocks = -(-ahead // self.layout.block_size)
        short = next((layer for layer, held in self.committed.items() if held < blocks), None)
        if short is not None:
            self.reserve(ahead, [short])

    def _grow(self, layer: int, blocks: int, pace: Callable[[], None]):
        """Each of a global layer's tables' kv-head ranges of blocks committed..blocks: past the
        shared files' pages, copied from share()'s source up to its end and zeroed after it (which
        commits them), and page-locked in pieces of at most PIN_PIECE_BYTES, or one growth step
        (whole pages), calling pace() after each (the heads' ranges between stay unheld)."""
        old = self.committed[layer]
        if blocks <= old:
            return
        step = growth_step(self.layout)
        source, copy_end = self._copying or (None, 0)
        copied_kinds = source._kinds() if source is not None else ()
        for k, kind in enumerate(self._kinds()):
            part = kind[layer][:, old:blocks]
            if not part.numel():
                continue
            block_bytes = part[0, 0].numel() * part.element_size()
            piece = max(1, PIN_PIECE_BYTES // (block_bytes * step)) * step
            for h in range(part.shape[0]):
                for a in range(old, blocks, piece):
                    b = min(a + piece, blocks)
                    own = max(a, self.shared_blocks)  # the first block of the piece that is this cache's own
                    copied = min(b, max(own, copy_end))  # and the end of those copied from share()'s source
                    if copied > own:
                        kind[layer][h, own:copied] = copied_kinds[k][layer][h, own:copied]
                    kind[layer][h, copied:b].zero_()
                    self._pinned.pin(kind[layer][h, a:b])
                    pace()
        self.committed[layer] = blocks
        if source is not None and min(self.committed.values()) >= copy_end:
            self._copying = None  # every layer holds its copies: source may change from here

    @property
    def dram_bytes(self) -> int:
        """DRAM this cache holds of its own: the sliding layers' tails, and every global table's
        reserved blocks less those it shares (counted once, with the shared prefix)."""
        layers = len(self.committed)
        held = sum(max(0, c - self.shared_blocks) for c in self.committed.values())
        return self.layout.dram_kv_bytes(sliding=True) + shared_prefix_bytes(self.layout, held) // max(layers, 1)

    def unshare(self, keep: bool):
        """Private pages again under the shared prefix, holding its bytes (keep) or zeros."""
        if self.shared is None:
            return
        with self._pinned.released():
            map_private(self.shared_tables(), self.shared_blocks, keep)
        self.shared, self.shared_blocks = None, 0

    @property
    def shared_bytes(self) -> int:
        """DRAM this cache holds in one copy with others (counted once, with the shared prefix)."""
        return shared_prefix_bytes(self.layout, self.shared_blocks)

    def advance(self, num_new: int):
        """num_new more tokens are in the cache (their K/V and side tables written)."""
        assert self.num_tokens + num_new <= self.layout.capacity, "the KV cache is full; raise max_seq_len"
        assert self.num_tokens + num_new <= min(self.committed.values(), default=1 << 62) * self.layout.block_size, \
            "reserve() before writing"
        self.num_tokens += num_new

    def reset(self):
        self.unshare(keep=False)
        self.num_tokens, self._copying = 0, None

    def truncate(self, num_tokens: int):
        """Keep the first num_tokens tokens (a follow-up diverges there); what lies after is
        written over. Not for sliding layers, whose DRAM holds only the tail."""
        assert num_tokens <= self.num_tokens and not self.layout.sliding
        if num_tokens < self.shared_blocks * self.layout.block_size:
            self.unshare(keep=True)  # no block that others hold is written
        self.num_tokens = num_tokens

    def place_tails(self, num_tokens: int):
        """Before a prefill of num_tokens: sliding layers keep the blocks that end the prompt."""
        end_block = -(-num_tokens // self.layout.block_size)
        for layer in range(self.layout.num_layers):
            if self.layout.is_sliding(layer):
                self.first_block[layer] = max(0, end_block - self.layout.sliding_blocks)

    def first_token(self, layer: int) -> int:
        return self.first_block[layer] * self.layout.block_size

    def tokens(self, layer: int, which: str, start: int, end: int) -> torch.Tensor:
        """K ("k") or V ("v") as stored, absolute positions start..end: a [KV, end-start, R] view."""
        return self._token_view(self.k[layer] if which == "k" else self.v[layer], layer, start, end)

    def scale_tokens(self, layer: int, which: str, start: int, end: int) -> torch.Tensor:
        """Their float16 scale words (q8_0 / q4_0): a [KV, end-start, D/32] view."""
        return self._token_view(self.k_scales[layer] if which == "k" else self.v_scales[layer], layer, start, end)

    def _token_view(self, t: torch.Tensor, layer: int, start: int, end: int) -> torch.Tensor:
        base = self.first_token(layer)
        assert base <= start <= end <= base + t.shape[1] * t.shape[2], (layer, start, end, base)
        return t.view(t.shape[0], -1, t.shape[-1])[:, start - base:end - base]

    def unquantized(self, layer: int, which: str, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """K or V of positions start..end widened to dtype: [KV, end-start, D]."""
        data = self.tokens(layer, which, start, end)
        if not self.layout.is_quantized:
            return data.to(dtype)
        return dequantize_kv(data, self.scale_tokens(layer, which, start, end), self.layout.kv_type, dtype)
