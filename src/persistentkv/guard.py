"""The page guard's host side: which trusted plans get a memory-safe copy of their page table.

A plan whose page-table values were not checked on the host (check_page_table=False, and every
graph-mode plan) carries a PageGuard. The first run() after each plan() launches the guard kernel
(kernels/guard.py) once for the pool it is given; the decode kernels of the step read the copy.
One launch per step, not per layer: run() of the later layers finds the copy made.
"""
from __future__ import annotations

import torch

from .launch import BoundLaunch, Launcher
from .page_inputs import PageTableArgs

_launcher: Launcher | None = None


def _guard_launcher() -> Launcher:
    global _launcher
    if _launcher is None:
        from .kernels.guard import guard_pages_kernel   # kernels load after the interpreter choice
        _launcher = Launcher(guard_pages_kernel)
    return _launcher


def guarded_extent(table: PageTableArgs) -> int:
    """Entries of the flat page table the decode kernel may address (its copy's length)."""
    if table.csr:
        return table.num_indices
    if table.rows == 0 or table.width == 0:   # a block table of no columns addresses nothing
        return 0
    return (table.rows - 1) * table.row_stride + table.width


class PageGuard:
    """Copies a plan's page table into `safe` (int32 [>= extent], the workspace's) with every
    entry outside [0, num_pages) replaced by 0, counting the used ones in info[6].
    leading: (page table, indptr or seq_lens); fixed: the kernel's further arguments but
    num_pages."""

    def __init__(self, table: PageTableArgs, *, safe: torch.Tensor, info: torch.Tensor,
                 page_size: int):
        from .kernels.guard import GUARD_BLOCK, guard_grid

        self.extent = guarded_extent(table)
        span = table.num_indices if table.csr else table.rows * table.width   # (row, column)s
        self.leading = (table.indices, table.leading[0])
        self.fixed = (safe, info, table.rows, table.row_stride, table.width, span)
        self.csr, self.page_size = table.csr, page_size
        self._constexprs = dict(PAGE_SIZE=page_size, CSR=table.csr, BLOCK=GUARD_BLOCK)
        self._grid = guard_grid(span)
        self._key = (table.csr, page_size, table.device.index,
                     *(t.data_ptr() % 16 for t in self.leading))
        self._bound: dict[int, BoundLaunch] = {}
        self._done_for: int | None = None

    def arm(self) -> None:
        """A new plan() of the same tables: their values may have changed, copy them again."""
        self._done_for = None

    def ensure(self, num_pages: int) -> None:
        """Copy the table for a pool of num_pages pages, unless this plan's copy is for that pool."""
        if self._done_for == num_pages:
            return
        launch = self._bound.get(num_pages)
        if launch is None:
            launch = self._bound[num_pages] = _guard_launcher().bind(
                grid=self._grid, key=self._key, fixed=(*self.fixed, num_pages),
                constexprs=self._constexprs, num_warps=4, num_stages=1,
                device_index=self.leading[0].device.index)
        launch(*self.leading)
        self._done_for = num_pages
