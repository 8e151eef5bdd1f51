"""Launch configurations and split-size rules: data beside the kernels, chosen deterministically.

Values come from `persistentkv sweep` on the H200 (docs/perf-notes.md has the measurements).
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
from dataclasses import dataclass

from .runtime import next_power_of_2


# tiles of more query rows than this take long_block_n for every task (KernelConfig.tile_tokens)
LONG_TILE_MAX_ROWS = 16
# default_config's KernelConfig.small_step_kv_bytes_per_sm at head dims of 128 and more: 768 KiB,
# about 99 MiB (104 MB) on 132 SMs. Measured (v36, H100, 4-16 queries a row at 32/8/128, 64/8/128,
# 28/4/128 and 16/8/256): M-blocks of half the tile took the steps of 2-67 MB of K/V 5-33%
# faster, and cost 1-49% on those of 134 MB and more; at head dim 64 (gpt-oss, 8 queries) they
# lost 1-59% from 8 MB, so not there.
SMALL_STEP_KV_BYTES_PER_SM = 768 << 10
# default_config's KernelConfig.balanced_from_tokens at head dims 129-256 (KernelConfig's
# default, 16K, elsewhere). Measured (v42, H100s, gemma2-9b 16/8/256): chunks from 2048 tokens
# took B8 bimodal 4% faster (and steady, where its splits moved 2-4% between processes), B4
# uniform, B8 uniform, B4 L32K, B8 L32K and B32 L8K 0.2-1.2%, B1 L128K the same, and cost B8
# L8K (splits of 2048) 0.7-1.6%; 2560 keeps B8 L8K on its splits.
WIDE_HEAD_BALANCED_FROM_TOKENS = 2560
# KernelConfig.waves at most: the task buffers grow with it (at 1e12 a plan asked for 128 TB)
MAX_WAVES = 1024


@dataclass(frozen=True)
class KernelConfig:
    """Tile and launch shape of the decode kernel.

    block_n: tokens per K/V tile; fp8_block_n: tokens per tile of an fp8 cache (None: block_n);
    num_warps, num_stages: Triton's launch options (num_stages is the
    software-pipelining depth of the token loop); waves: target (row, KV head, split) tasks per SM
    when the split size is chosen; min_split_tokens: smallest split worth a task of its own;
    programs_per_sm: persistent programs per SM of the decode kernel; balanced_from_tokens: the
    default rule plans balanced chunks, not the split rule's tasks, where the split rule's split is
    at least this many tokens (0: only where its tasks overflow a round; schedule.py);
    one_round: the balanced split grows (by at most schedule.ONE_ROUND_SLACK) until a step's
    tasks fit in the waves x SMs target, instead of each row's last, partial split overflowing it by up to one task per row
    (schedule.default_split_pages). Together (2 programs per SM, waves 2): one task per program on
    split steps, and four or more rounds of whole rows on large batches; measured best against 3
    programs per SM (which fit with 70 KB of shared memory each) on the H200 grid
    (docs/perf-notes.md, v4). pdl: programmatic dependent launch (compute capability 9.0+; off
    under the interpreter and on older GPUs): the kernel is launched so that it may start while the
    kernel before it on the stream finishes, and waits for that kernel's writes (griddepcontrol.wait)
    before its first load; off by default, measured by `persistentkv layer-chain`.
    max_registers: Triton's `maxnreg`, a cap on the registers of a thread (None: the compiler's
    choice), so that more programs fit an SM's 64K registers (128 threads each: 168 for three),
    or so that a compiler that aims at three programs an SM (168) does not spill where the
    persistent grid runs two; max_registers_rows: the cap applies to programs of at most this
    many query rows only (None: every program; KernelConfig.registers).
    long_block_n: tokens per K/V tile of the tasks of at least long_from_tokens tokens (None:
    block_n for every task; fp16/bf16 caches only): a task's loop is chosen by its length on the
    device, so one plan (and one graph) serves short and long tasks alike.
    max_tile_rows: most query rows (query tokens x group) of one program's tile (None: a task's
    whole tile): a task of more is run by row_blocks programs (M-blocks) of max_tile_rows rows
    each, which read the same K/V tiles (the second from L2) and merge their own rows. 64
    measured (v31, 16 queries a row): 128-row tiles in two blocks of 64 took gpt-oss B1 L1K from
    22.8 to 10.6 us and llama3-70b (64/8/128) B32 L1K from 176 to 68; blocks of 32 lost on the
    larger steps (gpt-oss B32 L1K 93 us), and of 16 at llama3-8b's 32 rows on all but B1 L1K.
    min_tile_rows: a program's tile of more than 16 query rows is padded to at least this many
    (Triton compiles tl.dot on sm_90 to the warp-group MMA only for tiles of 64 rows; 32 rows
    run mma.sync). 64 measured (v32, H100): 32-row tiles (8 queries at group 4, 4 at group 8)
    padded to 64 ran 1-7% faster on every cell, llama3-8b's 8-query B1 L1K 12.05 -> 11.2 us;
    16 (none) past head dim 128 (default_config).
    small_step_kv_bytes_per_sm: the tile of a step whose page table holds at most this many
    bytes of K/V per SM (counted at 16 bits an element) runs in M-blocks of half its rows
    (KernelConfig.for_step; 0: never, and no step is large either). More, smaller programs
    take the latency-bound steps; one tile reads each K/V tile once on the bandwidth-bound ones.
    large_step_tile_rows: a step known to hold more than that (KernelConfig.for_step) runs
    tiles of this many rows or more in M-blocks of this many, where this config's blocks are
    smaller (None: as this config): fewer programs re-read each K/V tile from L2.
    value_blocks: programs that share a task's output columns (head_dim padded to a power of
    two / value_blocks each, at least 16) where a program's tile has 64 rows or more (the
    warp-group MMA's): each reads all of K for the scores and its share of V, and holds its
    share of the accumulator. value_block_stages: those programs' num_stages (None: num_stages),
    so that their tile's shared memory leaves room for programs_per_sm of them.
    value_block_rows: the fewest rows of a program's tile that value blocks apply to (64: the
    warp-group MMA's; 16, an experiment for latency-bound small steps: more programs, each with
    a share of the PV product and of the merge, at the cost of every one computing the scores;
    measured 1.0-1.4x slower with two blocks and 1.0-2.7x with four, docs/perf-notes.md v51).
    first_pages: the planner also writes each task's first K/V tile's page indices beside its
    record (kernels/plan.py), and the decode kernel reads them from there: its first K/V load
    waits on one dependent read (the record's) instead of two (the record's, then the page
    table's). Where a task's first tile spans more than kernels.plan.FIRST_PAGE_SLOTS pages
    (small pages, long tiles) the kernel reads the page table as before. With several query
    tokens a row, the planner also writes there the row's first query, query count and length,
    so that q's load waits on the record's index only, not on qo_indptr after the record.
    Off by default: 1-3% faster on a few small steps at groups 4 and 7, up to 9% slower at
    group 8 with one KV head (docs/perf-notes.md v51).
    page_prefetch_tiles: each K/V tile also asks the L2 for the page indices of the tile this
    many tiles ahead (0: off), so that the page table's reads, one DRAM miss a tile behind the
    K/V stream's, land before the pipelined loads need them (docs/perf-notes.md v53). An
    experiment, off by default until measured.
    page_prefetch_task: each task asks the L2 for all its page indices at its start, one a
    32-byte sector (page_prefetch_tiles' aim, with one prefetch a task instead of one a tile;
    docs/perf-notes.md v55). An experiment, off by default until measured.
    keep_page_table: the page indices are loaded marked evict_last, so that the page table, the
    same for every layer of a step, stays in the L2 past the K/V stream between two layers'
    launches (docs/perf-notes.md v55). An experiment, off by default until measured.
    """

    block_n: int = 64
    fp8_block_n: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    waves: float = 2.0
    min_split_tokens: int = 128
    programs_per_sm: int = 2
    balanced_from_tokens: int = 16384
    one_round: bool = True
    pdl: bool = False
    max_registers: int | None = None
    max_registers_rows: int | None = None
    long_block_n: int | None = None
    long_from_tokens: int = 2048
    max_tile_rows: int | None = 64
    min_tile_rows: int = 64
    small_step_kv_bytes_per_sm: int = 0
    large_step_tile_rows: int | None = None
    value_blocks: int = 1
    value_block_stages: int | None = None
    value_block_rows: int = 64
    first_pages: bool = False
    page_prefetch_tiles: int = 0
    page_prefetch_task: bool = False
    keep_page_table: bool = False

    def step_size(self, *, kv_bytes: int, exact: bool, sm_count: int) -> str:
        """'small', 'large' or 'either' for a step whose page table can hold kv_bytes of K/V
        (at 16 bits an element; exact: the step holds that much, not just at most): small at
        most small_step_kv_bytes_per_sm x sm_count, large past it where exact, else either
        (always either when small_step_kv_bytes_per_sm is 0)."""
        if self.small_step_kv_bytes_per_sm == 0:
            return "either"
        if kv_bytes <= self.small_step_kv_bytes_per_sm * sm_count:
            return "small"
        return "large" if exact else "either"

    def for_step(self, *, tile_rows: int, size: str) -> KernelConfig:
        """The configuration a step of `size` (step_size) runs: this one, or for a small step,
        tiles of more than 16 query rows (query tokens x group) cut into M-blocks of half their
        rows (16 at least) where this one cuts them less; for a large one, tiles of
        large_step_tile_rows rows or more in blocks of that many where this one cuts them
        more."""
        if size not in ("small", "large", "either"):
            raise ValueError(f"size must be 'small', 'large' or 'either', got {size!r}")
        rows = self.block_rows(tile_rows=tile_rows)
        if size == "small" and tile_rows > 16:
            half = max(16, next_power_of_2(tile_rows) // 2)
            if rows > half:
                return dataclasses.replace(self, max_tile_rows=half)
        wide = self.large_step_tile_rows
        if size == "large" and wide is not None and tile_rows >= wide and rows < wide:
            return dataclasses.replace(self, max_tile_rows=wide)
        return self

    def row_blocks(self, *, tile_rows: int) -> int:
        """Programs (M-blocks) that share a task whose tile has tile_rows query rows (padded to
        a power of two, at least 16): 1, or enough blocks of max_tile_rows rows."""
        padded = max(16, next_power_of_2(tile_rows))
        if self.max_tile_rows is None or padded <= self.max_tile_rows:
            return 1
        return padded // self.max_tile_rows

    def block_rows(self, *, tile_rows: int) -> int:
        """Query rows of one program's tile: tile_rows, or an M-block's share of them."""
        return -(-tile_rows // self.row_blocks(tile_rows=tile_rows))

    def program_rows(self, *, tile_rows: int) -> int:
        """Rows of one program's tile (G_PAD): a block's rows as a power of two, at least 16; a
        whole tile of more than 16 padded to min_tile_rows (at most max_tile_rows). M-blocks are
        never padded: a block's rows are where the next block's start."""
        blocks = self.row_blocks(tile_rows=tile_rows)
        rows = max(16, next_power_of_2(tile_rows)) // blocks
        if blocks > 1 or rows <= 16:
            return rows
        return max(rows, min(self.min_tile_rows, self.max_tile_rows or self.min_tile_rows))

    def column_blocks(self, *, tile_rows: int) -> int:
        """Programs that share a task's output columns: value_blocks where a program's tile
        has value_block_rows rows or more, else 1."""
        rows = self.program_rows(tile_rows=tile_rows)
        return self.value_blocks if rows >= self.value_block_rows else 1

    def stages(self, *, tile_rows: int) -> int:
        """Triton's num_stages for tasks of tile_rows query rows: value_block_stages where the
        programs share a task's columns (column_blocks > 1) and it is set, else num_stages."""
        if self.value_block_stages is not None and self.column_blocks(tile_rows=tile_rows) > 1:
            return self.value_block_stages
        return self.num_stages

    def head_items(self, *, tile_rows: int) -> int:
        """Programs that one task takes per KV head: its M-blocks x its value blocks."""
        return self.row_blocks(tile_rows=tile_rows) * self.column_blocks(tile_rows=tile_rows)

    def registers(self, *, tile_rows: int) -> int | None:
        """Triton's maxnreg for tasks of tile_rows query rows (query tokens x group): max_registers
        where a program's tile has at most max_registers_rows rows, else None (the compiler's)."""
        if self.max_registers_rows is not None and \
                self.program_rows(tile_rows=tile_rows) > self.max_registers_rows:
            return None
        return self.max_registers

    def tile_shape(self, *, tile_rows: int, kv_fp8: bool) -> dict:
        """decode_constexprs' tile arguments for tasks of tile_rows query rows (query tokens x
        group) over a cache of this kind: block_n, long_block_n, long_from_tokens (0 without a
        long tile), m_blocks and g_pad (the K/V tiles are a program's block's, the rows the whole
        tile's), d_blocks (column_blocks)."""
        block = self.block_rows(tile_rows=tile_rows)
        long_block_n = self.long_tile_tokens(kv_fp8=kv_fp8, tile_rows=block)
        return dict(block_n=self.tile_tokens(kv_fp8=kv_fp8, tile_rows=block),
                    long_block_n=long_block_n,
                    long_from_tokens=self.long_from_tokens if long_block_n else 0,
                    m_blocks=self.row_blocks(tile_rows=tile_rows),
                    g_pad=self.program_rows(tile_rows=tile_rows),
                    d_blocks=self.column_blocks(tile_rows=tile_rows))

    def tile_tokens(self, *, kv_fp8: bool, tile_rows: int = 1) -> int:
        """Tokens per K/V tile for a cache of this kind and tiles of tile_rows query rows (query
        tokens x group): long_block_n for every task past LONG_TILE_MAX_ROWS rows."""
        if kv_fp8:
            return self.fp8_block_n or self.block_n
        return self.long_block_n if self._one_long_tile(tile_rows) else self.block_n

    def long_tile_tokens(self, *, kv_fp8: bool, tile_rows: int = 1) -> int:
        """Tokens per K/V tile of a long task for a cache of this kind and tiles of tile_rows
        query rows (0: none of its own)."""
        if kv_fp8 or self.long_block_n is None or self._one_long_tile(tile_rows):
            return 0
        return self.long_block_n

    def _one_long_tile(self, tile_rows: int) -> bool:
        """Tiles of more than LONG_TILE_MAX_ROWS rows read long_block_n tokens in every task:
        the second loop's registers and shared memory cost more there than the short tile saves
        (gpt-oss 64/8 at 4 and 16 queries a row: docs/perf-notes.md, v28)."""
        return self.long_block_n is not None and tile_rows > LONG_TILE_MAX_ROWS

    def __post_init__(self):
        for field in dataclasses.fields(self):   # numpy integers as ints (hashing, equality)
            value = getattr(self, field.name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
                object.__setattr__(self, field.name, int(value))
        for name in ("block_n", "num_warps", "num_stages", "min_split_tokens", "programs_per_sm",
                     "long_from_tokens", "value_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KernelConfig.{name} must be a positive int, got {value!r}")
        for name in ("balanced_from_tokens", "small_step_kv_bytes_per_sm", "page_prefetch_tiles"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"KernelConfig.{name} must be an int >= 0, got {value!r}")
        value = self.value_block_stages
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"KernelConfig.value_block_stages must be None or a positive int, "
                             f"got {value!r}")
        for name in ("block_n", "fp8_block_n", "long_block_n", "max_tile_rows", "min_tile_rows",
                     "max_registers_rows", "large_step_tile_rows", "value_block_rows"):
            value = getattr(self, name)
            if value is None and name != "block_n":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 16 \
                    or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two >= 16, got {value!r}")
        if self.num_warps & (self.num_warps - 1) or self.num_warps > 32:
            raise ValueError(f"KernelConfig.num_warps must be a power of two up to 32, got "
                             f"{self.num_warps!r}")
        if self.value_blocks & (self.value_blocks - 1):
            raise ValueError(f"KernelConfig.value_blocks must be a power of two, got "
                             f"{self.value_blocks!r}")
        if self.long_block_n is not None and self.long_block_n <= self.block_n:
            raise ValueError(f"KernelConfig.long_block_n must be None or above block_n "
                             f"({self.block_n}), got {self.long_block_n!r}")
        for name in ("one_round", "pdl", "first_pages", "page_prefetch_task", "keep_page_table"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"KernelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        value = self.max_registers
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 24 <= value <= 255 or value % 8):
            raise ValueError(f"KernelConfig.max_registers must be None or a multiple of 8 in "
                             f"[24, 255], got {value!r}")
        waves = self.waves
        if isinstance(waves, bool) or not isinstance(waves, (int, float)) \
                or not 0 < waves <= MAX_WAVES:
            raise ValueError(f"KernelConfig.waves must be in (0, {MAX_WAVES}], got {waves!r}")


@functools.lru_cache(maxsize=None)
def default_config(*, head_dim: int, num_kv_heads: int) -> KernelConfig:
    """The default for a shape; each rule's measurements are in docs/perf-notes.md (version):
    - K/V tiles of about 4096 elements (block_n x head_dim) at three stages, two programs an SM
      (v4, v8).
    - Head dim 64 with 4 or more KV heads (gpt-oss): 64-token tiles for tasks under 1K tokens,
      128 from there (v27) and for tiles past 16 rows (v28); fewer KV heads keep 64, where 128
      cost the small, latency-bound steps (v22, v27). An fp8 cache reads 128-token tiles there
      and at head dim 128, the fp16 tile's bytes (v11).
    - Tiles of more than 16 query rows padded to 64 rows, the warp-group MMA's, up to head dim 128
      (v32); past it the padded tile spills (v33).
    - Head dim 129-256 (Gemma-2): 32-token tiles; programs of at most 16 rows capped at 224
      registers, where the compiler's 168 spill (v34); balanced chunks from splits of
      WIDE_HEAD_BALANCED_FROM_TOKENS (v42).
    - Head dim 257-512: 16-token tiles (32 spill, v10), splits of at least 32 tokens (v33), tiles
      past 16 rows in M-blocks of 16 (v34); large steps run tiles of 64 rows or more as 64-row
      programs, two value blocks of a task's columns at two stages (v37, v38).
    - From head dim 128, small steps cut tiles past 16 rows in half (SMALL_STEP_KV_BYTES_PER_SM,
      v36)."""
    small = SMALL_STEP_KV_BYTES_PER_SM if head_dim >= 128 else 0
    if head_dim > 256:
        return KernelConfig(block_n=16, min_split_tokens=32, min_tile_rows=16, max_tile_rows=16,
                            small_step_kv_bytes_per_sm=small, large_step_tile_rows=64,
                            value_blocks=2, value_block_stages=2)
    if head_dim > 128:
        return KernelConfig(block_n=32, min_tile_rows=16, max_registers=224, max_registers_rows=16,
                            small_step_kv_bytes_per_sm=small,
                            balanced_from_tokens=WIDE_HEAD_BALANCED_FROM_TOKENS)
    if head_dim <= 64 and num_kv_heads >= 4:
        return KernelConfig(block_n=64, fp8_block_n=128, long_block_n=128, long_from_tokens=1024,
                            small_step_kv_bytes_per_sm=small)
    return KernelConfig(fp8_block_n=128 if head_dim == 128 else None,
                        small_step_kv_bytes_per_sm=small)
