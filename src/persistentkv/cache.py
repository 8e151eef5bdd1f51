"""Paged KV cache: one page pool per layer, all sharing one page allocator and page table.

Layouts, as FlashInfer names them (P pages, H KV heads, S tokens per page, D head dim):
    "HND": [P, 2, H, S, D]      "NHD": [P, 2, S, H, D]      (index 0 of dim 1 is K, 1 is V)
and one of our own, "HND_VT": HND's shape and K, with each (page, head) block of V holding V
transposed (V[p, h, s, d] at element d * S + s of the block): a page's tokens are contiguous for
each d, so a kernel reads V's tiles as it reads K's (an e4m3 V tile is otherwise read byte by
byte; docs/perf-notes.md, v17). Its contract: every slot holds a finite value, since the kernel
reads a row's last page whole (the slots past the row's length get no weight, and 0 x NaN would
be NaN); an HND_VT PagedKVCache is zero-filled for that, and zeroes V (its per-token scales
set to 1) in every page it takes back, so a page's next sequence does not inherit a NaN or inf
in the slots it leaves unwritten. FlashInfer and vLLM do not read it.
An fp8 cache (dtype=torch.float8_e4m3fn) quantizes on append, with scales per tensor or per token
(quant.py).
"""
from __future__ import annotations

import math
from typing import Iterable

import numpy as np
import torch

from .allocator import OutOfPagesError, PageAllocator
from .checks import check_count, check_device, check_head_dim
from .page_table import PageTable
from .quant import FP8, SCALE_GRANULARITIES, check_scale, quantize, row_scales

LAYOUTS = ("NHD", "HND", "HND_VT")
QUANTIZE_CHUNK_ELEMENTS = 1 << 26   # fp32 elements quantized at once when an fp8 pool is filled
CACHE_DTYPES = (torch.float16, torch.bfloat16)

__all__ = ["PagedKVCache", "OutOfPagesError", "LAYOUTS", "CACHE_DTYPES", "check_layout",
           "check_v_transposed_cache", "v_transposed"]


def v_transposed(pool: torch.Tensor) -> torch.Tensor:
    """An HND_VT pool's V as a [P, H, D, S] view (pool: a contiguous [P, 2, H, S, D])."""
    p, _, h, page, d = pool.shape
    return pool.view(p, 2, h, d, page)[:, 1]


def check_v_transposed_page(layout: str, page_size: int) -> None:
    """HND_VT takes pages of a power-of-two size (the kernel finds a tile's slots from that)."""
    if layout == "HND_VT" and page_size & (page_size - 1):
        raise ValueError(f"the HND_VT layout takes a page_size that is a power of two, "
                         f"got {page_size}")


def check_v_transposed_cache(k: torch.Tensor, *, page_size: int, head_dim: int) -> None:
    """An HND_VT cache as the kernels read it: k [P, H, S, D] with dense [S, D] blocks (V's
    blocks hold [D, S]) and a power-of-two page size."""
    check_v_transposed_page("HND_VT", page_size)
    if k.stride(2) != head_dim or k.stride(1) != page_size * head_dim:
        raise ValueError(f"an HND_VT cache's (page, head) blocks must be dense [page_size, "
                         f"head_dim] = [{page_size}, {head_dim}], got strides {k.stride()}")


def check_layout(layout: object, *, name: str = "layout") -> str:
    """One of LAYOUTS; `name`: the argument's, for the error."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"{name} must be one of {LAYOUTS}, got {layout!r}")
    return layout  # type: ignore[return-value]


class PagedKVCache:
    """Page pools for `num_layers` layers and the allocator that hands out their pages.

    Each pool is [num_pages, 2, ...] in `layout`; `pools[layer]` is what `DecodeWrapper.run` takes,
    with `scales(layer)` beside it for an fp8 cache. dtype=torch.float8_e4m3fn: append() takes
    K/V in fp16, bf16 or fp32 and quantizes them, with kv_scale="tensor" (the fixed k_scale and
    v_scale, as calibrated for the model) or "token" (one scale per token and KV head, its amax /
    448, in `kv_scales[layer]`: fp32 [num_pages, 2, num_kv_heads, page_size]).
    """

    def __init__(self, *, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float16, layout: str = "NHD",
                 device: torch.device | str = "cpu", shuffle_seed: int | None = None,
                 init: str = "empty", kv_scale: str = "tensor", k_scale: float = 1.0,
                 v_scale: float = 1.0):
        num_layers, num_kv_heads = (
            check_count(name, value, minimum=1) for name, value in
            (("num_layers", num_layers), ("num_kv_heads", num_kv_heads)))
        head_dim = check_head_dim(head_dim)
        if dtype not in (*CACHE_DTYPES, FP8):
            raise TypeError(f"dtype must be one of {(*CACHE_DTYPES, FP8)}, got {dtype}")
        if init not in ("empty", "zeros", "randn"):
            raise ValueError(f"init must be 'empty', 'zeros' or 'randn', got {init!r}")
        if kv_scale not in SCALE_GRANULARITIES:
            raise ValueError(f"kv_scale must be one of {SCALE_GRANULARITIES}, got {kv_scale!r}")
        k_scale, v_scale = check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)
        if dtype != FP8 and (kv_scale != "tensor" or (k_scale, v_scale) != (1.0, 1.0)):
            raise ValueError(f"kv_scale, k_scale and v_scale apply to an fp8 cache "
                             f"(dtype={FP8}), not to dtype={dtype}")
        if kv_scale == "token" and (k_scale, v_scale) != (1.0, 1.0):
            raise ValueError(f"k_scale and v_scale are a per-tensor cache's (kv_scale='tensor'); "
                             f"a per-token cache writes each token's own, got k_scale={k_scale}, "
                             f"v_scale={v_scale}")
        self.fp8 = dtype == FP8
        self.kv_scale, self.k_scale, self.v_scale = kv_scale, k_scale, v_scale
        self.layout = check_layout(layout)
        self.allocator = PageAllocator(num_pages, page_size, shuffle_seed=shuffle_seed)
        check_v_transposed_page(layout, self.allocator.page_size)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size, self.num_pages, self.dtype = self.allocator.page_size, self.allocator.num_pages, dtype
        self.device = check_device(device)
        inner = ((self.page_size, num_kv_heads) if layout == "NHD"
                 else (num_kv_heads, self.page_size))
        shape = (self.num_pages, 2, *inner, head_dim)
        if layout == "HND_VT" and init == "empty":   # the layout's contract: finite slots
            init = "zeros"
        make = {"empty": torch.empty, "zeros": torch.zeros, "randn": torch.randn}[init]
        per_token = self.fp8 and kv_scale == "token"
        self.kv_scales = [torch.ones(self.num_pages, 2, num_kv_heads, self.page_size,
                                     dtype=torch.float32, device=self.device)
                          for _ in range(num_layers)] if per_token else None
        if not self.fp8:
            self.pools = [make(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        else:                       # fp8: random values quantized as append() would
            self.pools = [torch.empty(shape, dtype=FP8, device=self.device)
                          for _ in range(num_layers)]
            # a few pages at a time: a whole pool in fp32 would be four times its own size
            step = max(1, QUANTIZE_CHUNK_ELEMENTS // math.prod(shape[1:]))
            for layer, pool in enumerate(self.pools):
                for first in range(0, self.num_pages, step):
                    x = make((min(step, self.num_pages - first), *shape[1:]),
                             dtype=torch.float32, device=self.device)
                    pool[first: first + x.shape[0]] = (self._quantized(x, layer, first)
                                                       if init == "randn" else x.to(FP8))

    # -- sequences -------------------------------------------------------------------------------
    def add_sequence(self, seq_id: object) -> None:
        self.allocator.add(seq_id)

    def free_sequence(self, seq_id: object) -> None:
        pages = list(self.allocator.sequence(seq_id).pages)
        zeros = self._v_zeros(pages)     # first: what can fail (memory) fails before any change
        self.allocator.free(seq_id)
        self._clear_v(pages, zeros)

    def seq_len(self, seq_id: object) -> int:
        return self.allocator.sequence(seq_id).length

    def scales(self, layer: int) -> dict:
        """run()'s scale arguments for `layer`: {} (fp16/bf16), {k_scale, v_scale} (fp8 per
        tensor) or {kv_scales} (fp8 per token)."""
        layer = check_count("layer", layer)
        if layer >= self.num_layers:
            raise ValueError(f"layer must be < num_layers={self.num_layers}, got {layer}")
        if not self.fp8:
            return {}
        if self.kv_scales is not None:
            return {"kv_scales": self.kv_scales[layer]}
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def append(self, seq_id: object, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens of every layer. k, v: [num_layers, n, Hkv, D] in the cache's dtype
        (an fp8 cache: fp16, bf16 or fp32, quantized here), on any device (copied to the
        cache's first).

        Pages are allocated as needed. On any error (bad k or v, OutOfPagesError when the pool
        runs out) the cache is left as it was: no token counted, no page taken, nothing written.
        """
        k, v = self._checked_kv(k, v)
        n = k.shape[1]
        pages_before = len(self.allocator.sequence(seq_id).pages)
        pages, slots = self.allocator.append(seq_id, n)
        try:
            self._write(pages, slots, k, v)
        except BaseException:
            taken = self.allocator.sequence(seq_id).pages[pages_before:]
            try:
                self._clear_v(taken, self._v_zeros(taken))
            finally:
                self.allocator.undo_append(seq_id, n, pages_before=pages_before)
            raise

    def append_tokens(self, seq_id: object, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Reserve slots for `num_tokens` tokens without writing them; returns (pages, slots)."""
        return self.allocator.append(seq_id, num_tokens)

    def write_slots(self, pages, slots, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [num_layers, n, Hkv, D] into the given (page, slot) of each layer's pool:
        pages and slots are n integers each (numpy, a list or a tensor), in [0, num_pages) and
        [0, page_size). Everything is checked before anything is written."""
        k, v = self._checked_kv(k, v)
        n = k.shape[1]
        index = []
        for name, values, bound in (("pages", pages, self.num_pages), ("slots", slots, self.page_size)):
            if isinstance(values, torch.Tensor):
                if values.device.type == "meta":
                    raise ValueError(f"{name} is on the meta device: it holds no indices")
                values = values.detach().cpu().numpy()
            try:
                arr = np.asarray(values)
            except ValueError:   # a ragged list
                raise ValueError(f"{name} must be {n} integers (k has {n} tokens), got "
                                 f"{values!r:.80}") from None
            if arr.shape != (n,) or (n and not np.issubdtype(arr.dtype, np.integer)):
                raise ValueError(f"{name} must be {n} integers (k has {n} tokens), got "
                                 f"{arr.dtype} of shape {list(arr.shape)}")
            bad = np.flatnonzero((arr < 0) | (arr >= bound))
            if len(bad):
                raise ValueError(f"{name}[{bad[0]}]={arr[bad[0]]} is outside [0, {bound})")
            index.append(arr.astype(np.int64))
        self._write(*index, k, v)

    def _checked_kv(self, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v checked (tensors of [num_layers, n, Hkv, D] in the cache's dtype, one n) and on
        the cache's device."""
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        expect = (self.num_layers, k.shape[1] if k.dim() == 4 else -1, self.num_kv_heads,
                  self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != expect:
                raise ValueError(f"{name} must be [num_layers, n, num_kv_heads, head_dim] = "
                                 f"{list(expect)}, got {list(t.shape)}")
            if self.fp8 and t.dtype not in (*CACHE_DTYPES, torch.float32):
                raise TypeError(f"{name}.dtype must be float16, bfloat16 or float32 (quantized "
                                f"into the fp8 cache), got {t.dtype}")
            if not self.fp8 and t.dtype != self.dtype:
                raise TypeError(f"{name}.dtype must be the cache's {self.dtype}, got {t.dtype}")
            if t.device.type == "meta":
                raise ValueError(f"{name} is on the meta device: it holds no values to write")
        return k.detach().to(self.device), v.detach().to(self.device)   # no autograd graph kept

    def _write(self, pages: np.ndarray, slots: np.ndarray, k: torch.Tensor, v: torch.Tensor) -> None:
        """Every layer's rows converted (quantized, with their scales) first, then written: a
        failure while converting writes nothing."""
        if len(pages) == 0:
            return
        p = torch.from_numpy(np.asarray(pages, dtype=np.int64)).to(self.device)
        s = torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(self.device)
        converted = []
        for layer in range(len(self.pools)):
            for kv, src in ((0, k), (1, v)):
                rows, scale = src[layer], None                           # [n, Hkv, D]
                if self.kv_scales is not None:                           # fp8, per token
                    scale = row_scales(rows)                             # [n, Hkv]
                    rows = quantize(rows, scale[..., None])
                elif self.fp8:
                    rows = quantize(rows, self.k_scale if kv == 0 else self.v_scale)
                converted.append((layer, kv, rows, scale))
        for layer, kv, rows, scale in converted:
            pool = self.pools[layer]
            if scale is not None:
                self.kv_scales[layer][p, kv, :, s] = scale
            if self.layout == "NHD":
                pool[p, kv, s] = rows
            elif self.layout == "HND" or kv == 0:
                pool[p, kv, :, s] = rows
            else:                                                        # HND_VT's V
                v_transposed(pool)[p, :, :, s] = rows

    def _v_zeros(self, pages: list[int]) -> torch.Tensor | None:
        """What _clear_v writes into `pages` (None where nothing is cleared), made before any
        change: [pages, ...] zeros in the pools' dtype."""
        if self.layout != "HND_VT" or not pages:
            return None
        return torch.zeros((len(pages), *self.pools[0].shape[2:]), dtype=self.pools[0].dtype,
                           device=self.device)   # every layer's pool has one shape

    def _clear_v(self, pages: list[int], zeros: torch.Tensor | None) -> None:
        """HND_VT: V of `pages` back to zeros (per-token scales 1) in every layer, the state its
        contract asks of a page that no sequence holds (the module's docstring); other layouts
        mask the slots past a row's length and need nothing (zeros: _v_zeros(pages))."""
        if zeros is None:
            return
        p = torch.tensor(pages, dtype=torch.int64, device=self.device)
        for layer, pool in enumerate(self.pools):
            pool[p, 1] = zeros
            if self.kv_scales is not None:
                self.kv_scales[layer][p, 1] = 1.0

    def _quantized(self, x: torch.Tensor, layer: int, first: int) -> torch.Tensor:
        """Pages first.. of a pool, x (fp32, [n, 2, ...] in the layout), in fp8; their scales set
        (per token)."""
        if self.kv_scales is None:
            return torch.stack([quantize(x[:, 0], self.k_scale),
                                quantize(x[:, 1], self.v_scale)], dim=1)
        rows = x if self.layout != "NHD" else x.transpose(2, 3)          # [n, 2, H, S, D]
        scale = row_scales(rows)                                         # [n, 2, H, S]
        self.kv_scales[layer][first: first + x.shape[0]].copy_(scale)
        q = quantize(rows, scale[..., None])
        if self.layout == "HND_VT":     # V's blocks transposed, each token keeping its scale
            q[:, 1] = q[:, 1].transpose(2, 3).contiguous().view(q[:, 1].shape)
        return q if self.layout != "NHD" else q.transpose(2, 3).contiguous()

    # -- page tables -----------------------------------------------------------------------------
    def page_table(self, seq_ids: Iterable[object] | None = None) -> PageTable:
        """The page table of `seq_ids` (default: every live sequence, in insertion order)."""
        ids = self.allocator.sequence_ids if seq_ids is None else list(seq_ids)
        seqs = [self.allocator.sequence(i) for i in ids]
        return PageTable(
            row_pages=tuple(np.asarray(s.pages, dtype=np.int64) for s in seqs),
            seq_lens=np.asarray([s.length for s in seqs], dtype=np.int64),
            page_size=self.page_size,
        )
