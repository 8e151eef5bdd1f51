"""A lean launch path for a Triton kernel: Triton's own binding on the first call of a
specialization, a direct call into the compiled launcher after that.

Triton's `kernel[grid](...)` binds and specializes every argument on every call (tens of us of host
time with two dozen arguments), and its launcher calls `data_ptr()` and a driver query
(cuPointerGetAttribute) for every tensor argument. A `BoundLaunch` fixes everything but the first
few pointer arguments once: the key pins everything Triton specializes on (dtypes, pointer
alignment, the int arguments' values), the fixed tensors go to the compiled launcher as integer
addresses, and a call pays for one `data_ptr()` per leading tensor and the launch itself.
"""
from __future__ import annotations

import torch
from triton import knobs

from .runtime import interpreting

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (   # what Triton itself uses
    lambda index: torch.cuda.current_stream(index).cuda_stream)


_runtime_knobs = knobs.runtime


def _hooked() -> bool:
    """A profiler (or anything else) has registered a launch hook with Triton: launches then go
    through Triton's own path, which calls the hooks. Triton 3.6 keeps the hooks in a HookChain
    (never None); an older Triton in a plain attribute."""
    enter, exit_ = _runtime_knobs.launch_enter_hook, _runtime_knobs.launch_exit_hook
    return bool(getattr(enter, "calls", enter) or getattr(exit_, "calls", exit_))


class Launcher:
    """The compiled specializations of one kernel, shared by every BoundLaunch of it."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict[tuple, object] = {}
        self.names = list(kernel.arg_names)

    def bind(self, *, grid: tuple[int, ...], key: tuple, fixed: tuple, constexprs: dict,
             num_warps: int, num_stages: int, device_index: int) -> BoundLaunch:
        """A launch whose arguments after the leading tensors are `fixed` (tensors and scalars, in
        signature order), followed by `constexprs`."""
        return BoundLaunch(self, grid=grid, key=key, fixed=fixed, constexprs=constexprs,
                           num_warps=num_warps, num_stages=num_stages, device_index=device_index)


class BoundLaunch:
    """launch(*leading): launch with the leading tensor arguments on the current stream of the
    bound device; launch.with_pointers(leading, pointers) when the caller already holds their
    data_ptr()s. The fixed tensors must outlive it (the caller holds them)."""

    def __init__(self, launcher: Launcher, *, grid, key, fixed, constexprs, num_warps, num_stages,
                 device_index):
        self.launcher, self.key, self.fixed, self.constexprs = launcher, key, fixed, constexprs
        self.options = dict(num_warps=num_warps, num_stages=num_stages)
        self.grid, self.device_index = grid, device_index
        self.interpreted = interpreting()
        self.trailing = (*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in fixed),
                         *constexprs.values())
        self.direct = None
        compiled = None if self.interpreted else launcher.compiled.get(key)
        if compiled is not None:
            self._set_direct(compiled)

    def _set_direct(self, compiled) -> None:
        g = self.grid + (1,) * (3 - len(self.grid))
        self.direct = (compiled.run, g[0], g[1], g[2], compiled.function, compiled.packed_metadata)

    def __call__(self, *leading: torch.Tensor) -> None:
        self.with_pointers(leading, [t.data_ptr() for t in leading])

    def with_pointers(self, leading: tuple, pointers: list) -> None:
        """Launch; pointers[i] is leading[i].data_ptr()."""
        direct = self.direct
        if direct is not None and not _hooked():
            run, g0, g1, g2, function, metadata = direct
            run(g0, g1, g2, _raw_stream(self.device_index), function, metadata, None, None, None,
                *pointers, *self.trailing)
            return
        # Triton's own path: the first call of a specialization, the interpreter, or a profiler's
        # launch hook. The direct call passes arguments by position: they must follow the signature.
        names, n_args = self.launcher.names, len(leading) + len(self.fixed)
        if names != [*names[:n_args], *self.constexprs]:
            raise TypeError(f"{self.launcher.kernel.__name__}: constexprs {list(self.constexprs)} do "
                            f"not follow the signature {names[n_args:]}")
        compiled = self.launcher.kernel[self.grid](*leading, *self.fixed, **self.constexprs,
                                                   **self.options)
        if not self.interpreted:
            self.launcher.compiled[self.key] = compiled
            self._set_direct(compiled)
