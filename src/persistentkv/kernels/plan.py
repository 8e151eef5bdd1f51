"""The planner: one launch turns a step's page table, already on the device, into its task list.

It computes the step's features (active rows, longest row, total tokens), looks the schedule up in
the policy's decision table (a small device tensor) or takes the one given, picks the split size
by the one split rule, and writes the tasks longest first. Nothing travels to the host, so plan +
run can sit in one CUDA graph that serves every batch composition up to the buffers' capacity.
"""
import triton
import triton.language as tl

TASK_FIELDS = 8   # int32 per task record: (row, split, tok_lo, tok_hi, page_start, slot_start,
                  # num_splits, next task of the same chunk or -1)
INFO_FIELDS = 9   # int32 plan info: (task count, split tokens, choice code, claim counter,
                  # tasks that did not fit, chunks of a balanced plan (0: none), used page-table
                  # entries outside the pool (the page guard's), rows whose lengths the table
                  # cannot hold, rows whose query counts the tile cannot hold (the last two added
                  # to by every plan); the last three are reset by check() only)
FIRST_PAGE_SLOTS = 8   # page indices of a task's first K/V tile kept beside its record (at most)
FIRST_READ_FIELDS = 16  # int32 per record of first_pages: the first FIRST_PAGE_SLOTS pages, then
                        # (several query tokens a row) its row's first query, query count, length
READ_FIELDS = tl.constexpr(FIRST_READ_FIELDS)   # the kernels' names of the two
QUERY_FIELDS_AT = tl.constexpr(FIRST_PAGE_SLOTS)
BALANCED = tl.constexpr(-2)   # schedule.BALANCED_CODE
POLICY_EDGES = 8  # edges per feature in the policy's device table, padded with +inf


def query_fields(*, first_pages: bool, max_queries: int) -> int:
    """The planner's and the decode kernel's QUERY_FIELDS: the tile's query tokens a row where
    each task's first reads also hold its row's queries (first pages, several queries a row),
    else 0 (the kernels read qo_indptr and row_lens)."""
    return max_queries if first_pages and max_queries > 1 else 0


@triton.jit
def _split_rule(lens, active_rows, max_len, total, target_tasks, min_split_tokens,
                whole_row_min_rows, whole_row_slack, one_round_slack,
                PAGE_SIZE: tl.constexpr, ONE_ROUND_STEPS: tl.constexpr):
    """The split rule's split size in tokens (schedule.py describes the rule)."""
    split = tl.maximum(min_split_tokens, tl.cdiv(total, target_tasks).to(tl.int32))
    if (active_rows >= whole_row_min_rows) & (max_len.to(tl.float32)
                                              <= whole_row_slack * split.to(tl.float32)):
        split = max_len
    split = tl.maximum(tl.cdiv(split, PAGE_SIZE), 1) * PAGE_SIZE
    if ONE_ROUND_STEPS > 0:   # grow until the tasks fit in target_tasks, by at most one_round_slack
        balanced = split
        count = tl.sum(tl.cdiv(lens, split), axis=0)
        for _ in tl.static_range(ONE_ROUND_STEPS):
            row_splits = tl.cdiv(lens, split)
            fewer = tl.min(tl.where(row_splits > 1, tl.cdiv(lens, tl.maximum(row_splits - 1, 1)),
                                    1 << 30), axis=0)
            grow = (count > target_tasks) & (fewer < (1 << 30))
            split = tl.where(grow, tl.cdiv(fewer, PAGE_SIZE) * PAGE_SIZE, split)
            count = tl.sum(tl.cdiv(lens, split), axis=0)
        if (count > target_tasks) | (split.to(tl.float32) > one_round_slack * balanced.to(tl.float32)):
            split = balanced
    row_splits = tl.maximum(tl.cdiv(lens, split), 1)   # even splits: fewest pages, same counts
    even = tl.max(tl.cdiv(lens, row_splits), axis=0)
    return tl.maximum(tl.cdiv(even, PAGE_SIZE), 1) * PAGE_SIZE


@triton.jit
def _policy_code(edges_ptr, codes_ptr, active_rows, max_len, total, n_len_bins, n_spread_bins,
                 EDGES: tl.constexpr):
    """The decision table's code for the step's bin: (rows, longest row, spread = longest / mean),
    each binned by its edges as bisect_left does (the count of edges below the value)."""
    e = tl.arange(0, EDGES)
    rows = active_rows.to(tl.float64)
    longest = max_len.to(tl.float64)
    spread = tl.where(total > 0, longest * rows / tl.maximum(total, 1).to(tl.float64), 1.0)
    r = tl.sum((tl.load(edges_ptr + e) < rows).to(tl.int32), axis=0)
    l_bin = tl.sum((tl.load(edges_ptr + EDGES + e) < longest).to(tl.int32), axis=0)
    s = tl.sum((tl.load(edges_ptr + 2 * EDGES + e) < spread).to(tl.int32), axis=0)
    return tl.load(codes_ptr + (r * n_len_bins + l_bin) * n_spread_bins + s)


@triton.jit
def _write_first_pages(first_pages_ptr, indices_ptr, at, page_start, tok_lo, tok_hi, mask,
                       row_queries, PAGE_SIZE: tl.constexpr, FIRST_PAGES: tl.constexpr,
                       QUERY_FIELDS: tl.constexpr):
    """Records `at` [S, 1] (tasks of tokens [tok_lo, tok_hi), their row's pages from
    indices[page_start]): the page indices of their first FIRST_PAGES pages, as the table holds
    them, to first_pages[at] (int32 [capacity, FIRST_READ_FIELDS]; 0 past a task's last page);
    with QUERY_FIELDS, row_queries [1, 4] (the row's first query, query count and length) from
    field QUERY_FIELDS_AT."""
    slot = tl.arange(0, FIRST_PAGES)[None, :]
    page = tok_lo // PAGE_SIZE + slot                                                  # [S, P]
    entry = tl.load(indices_ptr + page_start.to(tl.int64) + page,
                    mask=mask & (page * PAGE_SIZE < tok_hi), other=0)
    record = first_pages_ptr + at.to(tl.int64) * READ_FIELDS
    tl.store(record + slot, entry, mask=mask)
    if QUERY_FIELDS:
        field = tl.arange(0, 4)[None, :]
        tl.store(record + QUERY_FIELDS_AT + field, row_queries + at * 0, mask=mask & (field < 3))


@triton.jit
def _write_tasks(tasks_ptr, first_pages_ptr, indices_ptr, row, seq_len, num_splits, first_full,
                 last_at, page_start, slot_start, split, fits, row_queries,
                 PAGE_SIZE: tl.constexpr, BLOCK_SPLITS: tl.constexpr, FIRST_PAGES: tl.constexpr,
                 QUERY_FIELDS: tl.constexpr):
    """Row `row`'s task records: splits 0 .. num_splits - 2 at first_full + j, the last at last_at
    (and with FIRST_PAGES, their first reads: _write_first_pages)."""
    fields = tl.arange(0, 8)[None, :]
    for s in tl.range(0, num_splits, BLOCK_SPLITS):
        j = s + tl.arange(0, BLOCK_SPLITS)[:, None]                                # [S, 1]
        at = tl.where(j < num_splits - 1, first_full + j, last_at)
        tok_lo = j * split
        tok_hi = tl.minimum(tok_lo + split, seq_len)
        record = tl.where(fields == 0, row, j)
        record = tl.where(fields == 2, tok_lo, record)
        record = tl.where(fields == 3, tok_hi, record)
        record = tl.where(fields == 4, page_start, record)
        record = tl.where(fields == 5, slot_start, record)
        record = tl.where(fields == 6, num_splits, record)
        record = tl.where(fields == 7, -1, record)
        tl.store(tasks_ptr + at.to(tl.int64) * 8 + fields, record, mask=(j < num_splits) & fits)
        if FIRST_PAGES > 0:
            _write_first_pages(first_pages_ptr, indices_ptr, at, page_start, tok_lo, tok_hi,
                               (j < num_splits) & fits, row_queries, PAGE_SIZE, FIRST_PAGES,
                               QUERY_FIELDS)


@triton.jit
def _write_chunked_tasks(tasks_ptr, first_pages_ptr, indices_ptr, row, seq_len, num_segments,
                         row_off, row_pages, first_chunk, chunk, total_pages, cont_at,
                         next_cont_at, mid, page_start, slot_start, fits, row_queries,
                         PAGE_SIZE: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
                         FIRST_PAGES: tl.constexpr, QUERY_FIELDS: tl.constexpr):
    """Row `row`'s tasks of a balanced plan: its pages [row_off, row_off + row_pages) of the
    step's page stream, cut at multiples of `chunk` pages. Segment j lies in chunk
    first_chunk + j; the task that starts a chunk is record c, a row's first segment that starts
    inside a chunk is the continuation record cont_at; the row's last segment links to the next
    row's continuation (next_cont_at) when that row starts inside the same chunk. With
    FIRST_PAGES, their first reads too (_write_first_pages)."""
    fields = tl.arange(0, 8)[None, :]
    row_end = row_off + row_pages
    for s in tl.range(0, num_segments, BLOCK_SPLITS):
        j = s + tl.arange(0, BLOCK_SPLITS)[:, None]                                # [S, 1]
        c = first_chunk + j
        lo = tl.maximum(row_off, c * chunk) - row_off
        hi = tl.minimum(row_end, (c + 1) * chunk) - row_off
        at = tl.where((j == 0) & mid, cont_at, c)
        linked = (j == num_segments - 1) & (row_end % chunk != 0) & (row_end < total_pages)
        tok_hi = tl.minimum(hi * PAGE_SIZE, seq_len)
        record = tl.where(fields == 0, row, j)
        record = tl.where(fields == 2, lo * PAGE_SIZE, record)
        record = tl.where(fields == 3, tok_hi, record)
        record = tl.where(fields == 4, page_start, record)
        record = tl.where(fields == 5, slot_start, record)
        record = tl.where(fields == 6, num_segments, record)
        record = tl.where(fields == 7, tl.where(linked, next_cont_at, -1), record)
        tl.store(tasks_ptr + at.to(tl.int64) * 8 + fields, record, mask=(j < num_segments) & fits)
        if FIRST_PAGES > 0:
            _write_first_pages(first_pages_ptr, indices_ptr, at, page_start, lo * PAGE_SIZE,
                               tok_hi, (j < num_segments) & fits, row_queries, PAGE_SIZE,
                               FIRST_PAGES, QUERY_FIELDS)


@triton.jit(do_not_specialize=["num_rows", "num_indices", "block_table_stride", "block_table_width",
                               "task_capacity", "partial_capacity", "choice", "target_tasks",
                               "chunk_target", "min_split_tokens", "balanced_from_tokens",
                               "whole_row_min_rows", "n_len_bins", "n_spread_bins",
                               "window_tokens"])
def plan_kernel(indptr_ptr, last_ptr, lens_ptr, indices_ptr, qo_indptr_ptr, num_rows, num_indices,
                block_table_stride, block_table_width, edges_ptr, codes_ptr, tasks_ptr,
                first_pages_ptr, info_ptr, row_lens_ptr,
                task_capacity, partial_capacity,
                choice, target_tasks, chunk_target, min_split_tokens, balanced_from_tokens,
                whole_row_min_rows, whole_row_slack, one_round_slack, n_len_bins, n_spread_bins,
                window_tokens,
                PAGE_SIZE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
                CSR: tl.constexpr, POLICY: tl.constexpr, ONE_ROUND_STEPS: tl.constexpr,
                EDGES: tl.constexpr, Q_PAD: tl.constexpr, FIRST_PAGES: tl.constexpr,
                QUERY_FIELDS: tl.constexpr):
    """Program b writes row b's tasks and its length (row_lens[b], the causal mask of several
    query tokens reads it); program 0 also writes the plan info. FIRST_PAGES > 0: it also copies
    each task's first FIRST_PAGES page indices from the table (indices: kv_indices, or the
    block table) to first_pages[record] (int32 [capacity, FIRST_READ_FIELDS]), unchecked (the
    decode kernel clamps them as the page guard does); QUERY_FIELDS > 0 (the tile's query tokens
    a row, with FIRST_PAGES): and from field QUERY_FIELDS_AT, the row's first query
    qo_indptr[b], its query count clamped to [0, QUERY_FIELDS] as the decode kernel clamps it,
    and its length (row_lens[b]), so that a task's first reads wait on no other.

    Row lengths: CSR seq_len = (indptr[b+1] - indptr[b] - 1) * PAGE_SIZE + last[b] (0 without
    pages), page start indptr[b]; block table seq_len = lens[b], page start b * block_table_stride.
    Lengths are clamped to what the table holds, so a bad table cannot send a read past it;
    program 0 adds the rows clamped (or with offsets out of order) to info[7] (check()).
    qo_indptr: read with Q_PAD or QUERY_FIELDS only (else any int32 tensor).
    Q_PAD > 0 (graph mode's qo_indptr, its values not read on the host): the decode kernel
    clamps each row's query count to [0, Q_PAD], the tile's; program 0 adds the rows whose
    count qo_indptr[b+1] - qo_indptr[b] is outside it (or whose start is negative) to info[8].
    A sliding window (window_tokens >= 0: the most positions a row's queries see, window_left +
    the tile's query count) drops each row's whole pages before its last window_tokens
    positions: the row then starts at its first kept page (page start and length move by the
    pages dropped, the decode kernel's positions count from there, row_lens holds the kept
    length), and the step's features, the split rule and the tasks see window tokens only.
    Choice code (POLICY: from the decision table, else `choice`): -2 balanced chunks of about
    total / chunk_target pages, -1 whole rows, n > 0 splits of n pages, 0 the default rule: the
    split rule's splits when their tasks fit in target_tasks and the split is under
    balanced_from_tokens (when > 0), else balanced chunks (info[2] says which: 0 or -2).
    Task order (split and grouped): every row's splits but its last (all of the split size) in
    row order, then the rows' last splits, longest first; each record's `next` is -1. Balanced:
    record c < info[5] starts chunk c, and each record's `next` links the chunk's further tasks.
    A step whose tasks do not fit in task_capacity, or whose tasks with a partial (the rows cut
    in two or more) do not fit in partial_capacity, plans no task and reports its task count in
    info[4].
    Grid: (BLOCK_ROWS,): programs past num_rows write nothing.
    """
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_ROWS)
    in_batch = offs < num_rows
    if CSR:
        lo_given = tl.load(indptr_ptr + offs, mask=in_batch, other=0)
        hi_given = tl.load(indptr_ptr + offs + 1, mask=in_batch, other=0)
        last_given = tl.load(last_ptr + offs, mask=in_batch, other=1)
        lo = tl.minimum(tl.maximum(lo_given, 0), num_indices)
        hi = tl.minimum(hi_given, num_indices)
        last = tl.minimum(tl.maximum(last_given, 1), PAGE_SIZE)
        lens = tl.where(hi > lo, (hi - lo - 1) * PAGE_SIZE + last, 0)
        cut = (lo_given < 0) | (hi_given > num_indices) | (hi_given < lo_given) | (
            (hi_given > lo_given) & (last != last_given))
    else:
        lo = offs * block_table_stride
        lens_given = tl.load(lens_ptr + offs, mask=in_batch, other=0)
        lens = tl.minimum(tl.maximum(lens_given, 0), block_table_width * PAGE_SIZE)
        cut = lens != lens_given
    cut_rows = tl.sum((cut & in_batch).to(tl.int32), axis=0)
    if Q_PAD > 0:
        q_lo = tl.load(qo_indptr_ptr + offs, mask=in_batch, other=0)
        q_count = tl.load(qo_indptr_ptr + offs + 1, mask=in_batch, other=0) - q_lo
        wrong_queries = (q_lo < 0) | (q_count < 0) | (q_count > Q_PAD)
        query_rows = tl.sum((wrong_queries & in_batch).to(tl.int32), axis=0)
    dropped = tl.where(window_tokens >= 0, tl.maximum(lens - window_tokens, 0) // PAGE_SIZE, 0)
    lo = lo + dropped
    lens = lens - dropped * PAGE_SIZE
    active = lens > 0
    active_rows = tl.sum(active.to(tl.int32), axis=0)
    max_len = tl.max(lens, axis=0)
    total = tl.sum(lens.to(tl.int64), axis=0)

    if POLICY:
        code = _policy_code(edges_ptr, codes_ptr, active_rows, max_len, total, n_len_bins,
                            n_spread_bins, EDGES)
    else:
        code = choice
    split = _split_rule(lens, active_rows, max_len, total, target_tasks, min_split_tokens,
                        whole_row_min_rows, whole_row_slack, one_round_slack, PAGE_SIZE,
                        ONE_ROUND_STEPS)
    split = tl.where(code > 0, code * PAGE_SIZE, split)
    split = tl.where(code < 0, tl.maximum(tl.cdiv(max_len, PAGE_SIZE), 1) * PAGE_SIZE, split)
    # the default rule: the split rule's tasks when they fit in one round and are short enough,
    # else balanced chunks
    over = tl.sum(tl.where(active, tl.cdiv(lens, split), 0), axis=0) > target_tasks
    long_split = (balanced_from_tokens > 0) & (split >= balanced_from_tokens)
    code = tl.where((code == 0) & (over | long_split), BALANCED, code)
    mine = offs == row
    my_len = tl.sum(tl.where(mine, lens, 0), axis=0)
    my_start = tl.sum(tl.where(mine, lo, 0), axis=0)
    tl.store(row_lens_ptr + row, my_len, mask=row < num_rows)
    row_queries = my_len * 0
    if QUERY_FIELDS > 0:   # the row's first query, its count as the decode kernel clamps it, length
        q_first = tl.load(qo_indptr_ptr + row, mask=row < num_rows, other=0)
        q_rows = tl.load(qo_indptr_ptr + row + 1, mask=row < num_rows, other=0) - q_first
        field = tl.arange(0, 4)[None, :]
        row_queries = tl.where(field == 0, q_first, tl.where(
            field == 1, tl.minimum(tl.maximum(q_rows, 0), QUERY_FIELDS), my_len))
    if code == BALANCED:
        num_tasks, split, num_chunks, fits = _plan_balanced(
            tasks_ptr, first_pages_ptr, indices_ptr, lens, active, mine, row, my_len, my_start,
            task_capacity, partial_capacity, chunk_target, min_split_tokens, row_queries,
            PAGE_SIZE, BLOCK_SPLITS, FIRST_PAGES, QUERY_FIELDS)
    else:
        num_tasks, fits = _plan_splits(tasks_ptr, first_pages_ptr, indices_ptr, lens, active,
                                       mine, row, my_len, my_start, split, task_capacity,
                                       partial_capacity, row_queries, PAGE_SIZE, BLOCK_ROWS,
                                       BLOCK_SPLITS, FIRST_PAGES, QUERY_FIELDS)
        num_chunks = num_tasks * 0
    if row == 0:
        tl.store(info_ptr, tl.where(fits, num_tasks, 0))
        tl.store(info_ptr + 1, split)
        tl.store(info_ptr + 2, code)
        tl.store(info_ptr + 3, 0)                        # the decode kernel's claim counter
        tl.store(info_ptr + 4, tl.where(fits, 0, num_tasks))
        tl.store(info_ptr + 5, tl.where(fits, num_chunks, 0))
        if cut_rows > 0:
            tl.store(info_ptr + 7, tl.load(info_ptr + 7) + cut_rows)
        if Q_PAD > 0:
            if query_rows > 0:
                tl.store(info_ptr + 8, tl.load(info_ptr + 8) + query_rows)


@triton.jit
def _plan_balanced(tasks_ptr, first_pages_ptr, indices_ptr, lens, active, mine, row, my_len,
                   my_start, task_capacity, partial_capacity, chunk_target, min_split_tokens,
                   row_queries, PAGE_SIZE: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
                   FIRST_PAGES: tl.constexpr, QUERY_FIELDS: tl.constexpr):
    """The balanced rule (schedule.py): the rows' pages end to end, in chunks of
    max(min_split_tokens, total / chunk_target) pages. A row cut in two or more segments has
    slots for their partials, in row order. Returns (tasks, chunk tokens, chunks, whether the
    tasks and their partials fit)."""
    pages = tl.where(active, tl.cdiv(lens, PAGE_SIZE), 0)
    total_pages = tl.sum(pages, axis=0)
    chunk = tl.maximum(tl.cdiv(tl.maximum(min_split_tokens, 1), PAGE_SIZE),
                       tl.cdiv(total_pages, chunk_target))
    off = tl.cumsum(pages, axis=0) - pages
    first_chunk = off // chunk
    segments = tl.where(active, (off + pages - 1) // chunk - first_chunk + 1, 0)
    multi = tl.where(segments > 1, segments, 0)
    base = tl.cumsum(multi, axis=0) - multi
    mid = active & (off % chunk != 0)                  # starts inside a chunk: a continuation
    mids_through = tl.cumsum(mid.to(tl.int32), axis=0)
    num_tasks = tl.sum(segments, axis=0)
    num_chunks = tl.cdiv(total_pages, chunk)
    fits = (num_tasks <= task_capacity) & (tl.sum(multi, axis=0) <= partial_capacity)
    my_segments = tl.sum(tl.where(mine, segments, 0), axis=0)
    my_mid = tl.sum(tl.where(mine, mid.to(tl.int32), 0), axis=0) > 0
    my_mids = tl.sum(tl.where(mine, mids_through, 0), axis=0)
    my_slot = tl.where(my_segments > 1, tl.sum(tl.where(mine, base, 0), axis=0), -1)
    _write_chunked_tasks(tasks_ptr, first_pages_ptr, indices_ptr, row, my_len, my_segments,
                         tl.sum(tl.where(mine, off, 0), axis=0),
                         tl.sum(tl.where(mine, pages, 0), axis=0),
                         tl.sum(tl.where(mine, first_chunk, 0), axis=0), chunk, total_pages,
                         num_chunks + my_mids - my_mid.to(tl.int32), num_chunks + my_mids, my_mid,
                         my_start, my_slot, fits, row_queries, PAGE_SIZE, BLOCK_SPLITS,
                         FIRST_PAGES, QUERY_FIELDS)
    return num_tasks, chunk * PAGE_SIZE, num_chunks, fits


@triton.jit
def _plan_splits(tasks_ptr, first_pages_ptr, indices_ptr, lens, active, mine, row, my_len,
                 my_start, split, task_capacity, partial_capacity, row_queries,
                 PAGE_SIZE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
                 FIRST_PAGES: tl.constexpr, QUERY_FIELDS: tl.constexpr):
    """Splits of `split` tokens: every row's splits but its last in row order, then the rows' last
    splits, longest first; a row of two or more has slots for their partials, in row order.
    Returns (tasks, whether the tasks and their partials fit)."""
    offs = tl.arange(0, BLOCK_ROWS)
    splits = tl.where(active, tl.cdiv(lens, split), 0)                          # [BLOCK_ROWS]
    num_tasks = tl.sum(splits, axis=0)
    full = tl.where(active, splits - 1, 0)            # splits of exactly `split` tokens
    first_full = tl.cumsum(full, axis=0) - full
    last_len = tl.where(active, lens - (splits - 1) * split, 0)
    multi = tl.where(splits > 1, splits, 0)
    fits = (num_tasks <= task_capacity) & (tl.sum(multi, axis=0) <= partial_capacity)
    first_slot = tl.cumsum(multi, axis=0) - multi

    my_splits = tl.sum(tl.where(mine, splits, 0), axis=0)
    my_first = tl.sum(tl.where(mine, first_full, 0), axis=0)
    my_last = tl.sum(tl.where(mine, last_len, 0), axis=0)
    my_slot = tl.where(my_splits > 1, tl.sum(tl.where(mine, first_slot, 0), axis=0), -1)
    longer = active & ((last_len > my_last) | ((last_len == my_last) & (offs < row)))
    last_at = tl.sum(full, axis=0) + tl.sum(longer.to(tl.int32), axis=0)

    _write_tasks(tasks_ptr, first_pages_ptr, indices_ptr, row, my_len, my_splits, my_first,
                 last_at, my_start, my_slot, split, fits, row_queries, PAGE_SIZE, BLOCK_SPLITS,
                 FIRST_PAGES, QUERY_FIELDS)
    return num_tasks, fits
