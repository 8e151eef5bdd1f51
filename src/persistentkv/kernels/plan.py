"""Planning on the GPU: the work-queue of a step built from the page table already on the device.

No value travels to the host, so plan + run can sit in one CUDA graph that serves every batch
composition up to the buffers' capacity (rows of length 0 are inactive).
"""
import triton
import triton.language as tl


@triton.jit
def plan_workqueue_kernel(indptr_ptr, last_ptr, lens_ptr, meta_ptr, tasks_ptr, num_tasks_ptr,
                          num_rows, task_capacity, split_tokens, block_table_stride,
                          PAGE_SIZE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                          BLOCK_SPLITS: tl.constexpr, CSR: tl.constexpr):
    """Program b: row b's meta (seq_len, page start, partial slot or -1) and its tasks.

    CSR: seq_len = (indptr[b+1] - indptr[b] - 1) * PAGE_SIZE + last[b] (0 without pages), page
    start = indptr[b]; else seq_len = lens[b], page start = b * block_table_stride. Tasks
    (row, split) for split < cdiv(seq_len, split_tokens) go at the exclusive prefix sum of the
    rows' split counts; program 0 writes their total to num_tasks. Grid: (num_rows,).
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
        tl.store(num_tasks_ptr, tl.sum(splits, axis=0))
