"""The page guard: a trusted page table made memory-safe in one launch per step.

The decode kernel reads K/V wherever a page index points. When the table's values were not
checked on the host, run() first copies them with this kernel into the planner's workspace,
every entry outside the pool replaced by page 0, and the decode kernels of the step read that
copy. The used entries that were outside are counted in info[6] (DecodeWrapper.check()).
"""
import triton
import triton.language as tl

GUARD_BLOCK = 1024   # page-table entries per program


def guard_grid(span: int) -> tuple[int]:
    """guard_pages_kernel's grid for `span` entries (one program at least)."""
    return (max(-(-span // GUARD_BLOCK), 1),)


@triton.jit(do_not_specialize=["num_rows", "row_stride", "width", "span", "num_pages"])
def guard_pages_kernel(indices_ptr, meta_ptr, safe_ptr, info_ptr, num_rows, row_stride, width,
                       span, num_pages, PAGE_SIZE: tl.constexpr, CSR: tl.constexpr,
                       BLOCK: tl.constexpr):
    """safe[e] = indices[e] if 0 <= indices[e] < num_pages else 0, for each entry e of the table.

    CSR: the entries e < span (kv_indices' length); meta: kv_indptr int32 [num_rows + 1], the
    entries [indptr[0], indptr[num_rows]) are used. Block table: the span = num_rows x width
    entries (row r, column c) at e = r * row_stride + c (rows may overlap: a stride under the
    width, as an expanded table's 0); meta: seq_lens int32 [num_rows], row r uses its columns
    c < min(cdiv(seq_lens[r], PAGE_SIZE), width). An entry that rows share is copied by each (the
    same value) and counted for each that uses it. info[6] += the used entries outside the pool.
    Grid: (cdiv(span, BLOCK),).
    """
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < span
    if CSR:
        at = offs
    else:
        row = offs // tl.maximum(width, 1)
        col = offs - row * width
        at = row * row_stride + col
    page = tl.load(indices_ptr + at, mask=inside, other=0)
    bad = (page < 0) | (page >= num_pages)
    tl.store(safe_ptr + at, tl.where(bad, 0, page), mask=inside)
    if CSR:
        lo = tl.load(meta_ptr)
        hi = tl.load(meta_ptr + num_rows)
        used = (offs >= lo) & (offs < hi)
    else:
        lens = tl.load(meta_ptr + row, mask=inside, other=0)
        used = col < tl.minimum(tl.cdiv(tl.maximum(lens, 0), PAGE_SIZE), width)
    count = tl.sum((bad & used & inside).to(tl.int32), axis=0)
    if count > 0:
        tl.atomic_add(info_ptr + 6, count, sem="relaxed", scope="gpu")
