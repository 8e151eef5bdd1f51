"""Planning on the GPU: the work-queue of a step built from the page table already on the device.

No value travels to the host, so plan + run can sit in one CUDA graph that serves every batch
composition up to the buffers' capacity (rows of length 0 are inactive).
"""
import triton
import triton.language as tl


@triton.jit
def plan_workqueue_kernel(indptr_ptr, last_ptr, lens_ptr, meta_ptr, tasks_ptr, plan_info_ptr,
                          num_rows, task_capacity, fixed_split_tokens, block_table_stride,
                          target_tasks, min_split_tokens, whole_row_min_rows, whole_row_slack,
                          one_round_slack,
                          PAGE_SIZE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                          BLOCK_SPLITS: tl.constexpr, CSR: tl.constexpr, ADAPTIVE: tl.constexpr,
                          ONE_ROUND_STEPS: tl.constexpr):
    """Program b: row b's meta (seq_len, page start, partial slot or -1) and its tasks.

    CSR: seq_len = (indptr[b+1] - indptr[b] - 1) * PAGE_SIZE + last[b] (0 without pages), page
    start = indptr[b]; else seq_len = lens[b], page start = b * block_table_stride.
    Split size: fixed_split_tokens, or with ADAPTIVE the host's rule (schedule.default_split_pages)
    on the step's own lengths: the tokens shared out as target_tasks tasks per KV head, each at
    least min_split_tokens; whole rows when at least whole_row_min_rows rows are active and no row
    is longer than whole_row_slack x that share; rounded up to whole pages; with ONE_ROUND_STEPS >
    0, grown (by at most one_round_slack) until the tasks fit in target_tasks; then the fewest
    pages that keep every row's split count (even splits).
    Tasks (row, split) for split < cdiv(seq_len, split) go at the exclusive prefix sum of the
    rows' split counts; program 0 writes (task count, split tokens) to plan_info.
    Grid: (num_rows,).
    """
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_ROWS)
    in_batch = offs < num_rows
    if CSR:
        lo = tl.load(indptr_ptr + offs, mask=in_batch, other=0)
        hi = tl.load(indptr_ptr + offs + 1, mask=in_batch, other=0)
        last = tl.load(last_ptr + offs, mask=in_batch, other=0)
        lens = tl.where(hi > lo, (hi - lo - 1) * PAGE_SIZE + last, 0)
    else:
        lens = tl.load(lens_ptr + offs, mask=in_batch, other=0)
    if ADAPTIVE:
        total = tl.sum(lens, axis=0)
        max_len = tl.max(lens, axis=0)
        active = tl.sum((lens > 0).to(tl.int32), axis=0)
        split_tokens = tl.maximum(min_split_tokens, tl.cdiv(total, target_tasks))
        if (active >= whole_row_min_rows) & (max_len.to(tl.float32)
                                             <= whole_row_slack * split_tokens.to(tl.float32)):
            split_tokens = max_len
        split_tokens = tl.maximum(tl.cdiv(split_tokens, PAGE_SIZE), 1) * PAGE_SIZE
        if ONE_ROUND_STEPS > 0:   # schedule._one_round_split
            balanced = split_tokens
            count = tl.sum(tl.cdiv(lens, split_tokens), axis=0)
            for _ in tl.static_range(ONE_ROUND_STEPS):
                row_splits = tl.cdiv(lens, split_tokens)
                fewer = tl.min(tl.where(row_splits > 1, tl.cdiv(lens, tl.maximum(row_splits - 1, 1)),
                                        1 << 30), axis=0)
                grow = (count > target_tasks) & (fewer < (1 << 30))
                split_tokens = tl.where(grow, tl.cdiv(fewer, PAGE_SIZE) * PAGE_SIZE, split_tokens)
                count = tl.sum(tl.cdiv(lens, split_tokens), axis=0)
            if (count > target_tasks) | (split_tokens.to(tl.float32)
                                         > one_round_slack * balanced.to(tl.float32)):
                split_tokens = balanced
        row_splits = tl.maximum(tl.cdiv(lens, split_tokens), 1)
        even_tokens = tl.max(tl.cdiv(lens, row_splits), axis=0)
        split_tokens = tl.maximum(tl.cdiv(even_tokens, PAGE_SIZE), 1) * PAGE_SIZE
    else:
        split_tokens = fixed_split_tokens
    splits = tl.cdiv(lens, split_tokens)                                     # [BLOCK_ROWS], 0 if inactive
    first_task = tl.cumsum(splits, axis=0) - splits
    partial_slots = tl.where(splits > 1, splits, 0)
    first_slot = tl.cumsum(partial_slots, axis=0) - partial_slots
    mine = offs == row
    my_len = tl.sum(tl.where(mine, lens, 0), axis=0)
    my_splits = tl.sum(tl.where(mine, splits, 0), axis=0)
    my_first = tl.sum(tl.where(mine, first_task, 0), axis=0)
    my_slot = tl.where(my_splits > 1, tl.sum(tl.where(mine, first_slot, 0), axis=0), -1)
    if CSR:
        page_start = tl.load(indptr_ptr + row)
    else:
        page_start = row * block_table_stride
    tl.store(meta_ptr + row, my_len)
    tl.store(meta_ptr + num_rows + row, page_start)
    tl.store(meta_ptr + 2 * num_rows + row, my_slot)
    for s in tl.range(0, my_splits, BLOCK_SPLITS):
        split = s + tl.arange(0, BLOCK_SPLITS)
        ok = split < my_splits
        tl.store(tasks_ptr + my_first + split, row + split * 0, mask=ok)
        tl.store(tasks_ptr + task_capacity + my_first + split, split, mask=ok)
    if row == 0:
        tl.store(plan_info_ptr, tl.sum(splits, axis=0))
        tl.store(plan_info_ptr + 1, split_tokens)
