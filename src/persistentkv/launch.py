"""A lean launch path for a Triton kernel: Triton's own binding on the first call of a
specialization, a direct call into the compiled launcher after that.

Triton's `kernel[grid](...)` binds and specializes every argument on every call (tens of us of host
time with two dozen arguments). The caller gives a `key` that pins everything Triton specializes on
(dtypes, pointer alignment, the int arguments' values); calls with a key seen before reuse the
compiled kernel.
"""
from __future__ import annotations

import torch
from triton import knobs

from .runtime import interpreting


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (   # what Triton itself uses
    lambda index: torch.cuda.current_stream(index).cuda_stream)


class Launcher:
    def __init__(self, kernel):
        self.kernel = kernel
        self._compiled: dict[tuple, object] = {}
        self._names = list(kernel.arg_names)

    def __call__(self, grid: tuple[int, ...], key: tuple, args: tuple, constexprs: dict, *,
                 num_warps: int, num_stages: int, device_index: int | None = None) -> None:
        """Launch on the current stream of device `device_index` (the current device if None).
        args: the runtime arguments in signature order; constexprs: the compile-time ones, which
        follow them in the signature."""
        hooked = knobs.runtime.launch_enter_hook is not None   # profilers want Triton's own path
        compiled = None if interpreting() or hooked else self._compiled.get(key)
        if compiled is None:
            # the direct call passes arguments by position: they must follow the signature
            if self._names != [*self._names[:len(args)], *constexprs]:
                raise TypeError(f"{self.kernel.__name__}: constexprs {list(constexprs)} do not follow "
                                f"the signature {self._names[len(args):]}")
            compiled = self.kernel[grid](*args, **constexprs, num_warps=num_warps,
                                         num_stages=num_stages)
            if not interpreting():
                self._compiled[key] = compiled
            return
        g = grid + (1,) * (3 - len(grid))
        if device_index is None:
            device_index = torch.cuda.current_device()
        compiled.run(g[0], g[1], g[2], _raw_stream(device_index), compiled.function,
                     compiled.packed_metadata, None, None, knobs.runtime.launch_exit_hook, *args,
                     *constexprs.values())
