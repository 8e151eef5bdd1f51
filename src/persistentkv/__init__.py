"""PersistentKV: paged-KV decode attention for grouped-query attention, with page-aware scheduling.

Names are imported on first use, so that a program (the CLI, a test) can choose Triton's CPU
interpreter (TRITON_INTERPRET=1) before any kernel is defined.
"""
import importlib

_EXPORTS = {
    "BACKENDS": "wrapper", "Choice": "schedule", "DecodePlan": "planner", "DecodeWrapper": "wrapper",
    "OutOfPagesError": "allocator", "PageAllocator": "allocator", "PageTable": "page_table",
    "PagedKVCache": "cache", "Policy": "policy", "TOLERANCE": "reference", "reference_decode": "reference",
    "relative_error": "reference",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'persistentkv' has no attribute {name!r}")
