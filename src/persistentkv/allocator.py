"""Page allocator: which pages of the pool hold which sequence. Pure Python, no torch."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from .checks import check_count


class OutOfPagesError(RuntimeError):
    """Raised when an append needs more free pages than the pool has; nothing was changed."""


@dataclass
class Sequence:
    """One sequence's pages, in token order, and its length in tokens."""

    pages: list[int] = field(default_factory=list)
    length: int = 0


class UnknownSequenceError(KeyError, ValueError):
    """A sequence id the allocator does not hold: a lookup's KeyError, and a ValueError (bad
    input) as the rest of the API raises."""

    def __str__(self) -> str:      # KeyError's own quotes the message
        return str(self.args[0])


def _hashable(seq_id: object) -> object:
    """A sequence id, which must be hashable (a dict key)."""
    try:
        hash(seq_id)
    except TypeError:
        raise TypeError(f"seq_id must be hashable (an int, str, tuple...), got "
                        f"{type(seq_id).__name__} {seq_id!r}") from None
    return seq_id


class PageAllocator:
    """Free list of `num_pages` pages of `page_size` tokens, shared by every layer's pool.

    With `shuffle_seed` set, the free list starts in a seeded random order, so that the pages of a
    sequence are scattered over the pool as in a server that has run for a while.
    """

    def __init__(self, num_pages: int, page_size: int, *, shuffle_seed: int | None = None):
        self.num_pages = check_count("num_pages", num_pages, minimum=1)
        self.page_size = check_count("page_size", page_size, minimum=1)
        free = list(range(self.num_pages))
        if shuffle_seed is not None:
            random.Random(check_count("shuffle_seed", shuffle_seed)).shuffle(free)
        # Pages are taken from the end of the list; reversed so that an unshuffled pool hands out 0, 1, 2...
        self._free: list[int] = free[::-1]
        self._seqs: dict[object, Sequence] = {}

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def free_pages(self) -> tuple[int, ...]:
        """The free list, in the order appends take its pages (the next page first)."""
        return tuple(reversed(self._free))

    def __contains__(self, seq_id: object) -> bool:
        return _hashable(seq_id) in self._seqs

    def sequence(self, seq_id: object) -> Sequence:
        try:
            return self._seqs[_hashable(seq_id)]
        except KeyError:
            raise UnknownSequenceError(f"unknown sequence id {seq_id!r}") from None

    @property
    def sequence_ids(self) -> list[object]:
        return list(self._seqs)

    def pages_needed(self, seq_id: object, num_tokens: int) -> int:
        """Pages that appending `num_tokens` tokens to `seq_id` would take from the free list."""
        num_tokens = check_count("num_tokens", num_tokens)
        seq = self.sequence(seq_id)
        return -(-(seq.length + num_tokens) // self.page_size) - len(seq.pages)

    # -- changes ---------------------------------------------------------------------------------
    def add(self, seq_id: object) -> None:
        if _hashable(seq_id) in self._seqs:
            raise ValueError(f"sequence id {seq_id!r} already exists")
        self._seqs[seq_id] = Sequence()

    def append(self, seq_id: object, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Reserve slots for `num_tokens` new tokens of `seq_id`; allocate pages as needed.

        Returns (pages, slots): int64 arrays [num_tokens], the page and the slot within it of each new
        token. Raises OutOfPagesError, changing nothing, when the free list is too short.
        """
        num_tokens = check_count("num_tokens", num_tokens)
        seq = self.sequence(seq_id)
        need = self.pages_needed(seq_id, num_tokens)
        if need > len(self._free):
            raise OutOfPagesError(
                f"sequence {seq_id!r} needs {need} more pages for {num_tokens} tokens, "
                f"but only {len(self._free)} of {self.num_pages} are free"
            )
        taken = self._free[len(self._free) - need:][::-1]   # as pop() would take them
        positions = np.arange(seq.length, seq.length + num_tokens, dtype=np.int64)
        table = np.asarray(seq.pages + taken, dtype=np.int64)
        pages = table[positions // self.page_size] if num_tokens else positions
        slots = positions % self.page_size
        # nothing changes before here, so a failure above (memory) leaves the allocator as it was
        del self._free[len(self._free) - need:]
        seq.pages.extend(taken)
        seq.length += num_tokens
        return pages, slots

    def undo_append(self, seq_id: object, num_tokens: int, *, pages_before: int) -> None:
        """Take back the last append of `num_tokens` tokens to `seq_id`, which had `pages_before`
        pages before it: its new pages go back to the free list as they came off it."""
        seq = self.sequence(seq_id)
        num_tokens = check_count("num_tokens", num_tokens)
        pages_before = check_count("pages_before", pages_before)
        left = seq.length - num_tokens
        if num_tokens > seq.length or pages_before > len(seq.pages) \
                or pages_before != -(-left // self.page_size):
            raise ValueError(f"sequence {seq_id!r} holds {seq.length} tokens on {len(seq.pages)} "
                             f"pages: it cannot take back num_tokens={num_tokens} to "
                             f"pages_before={pages_before} (its tokens left must fill them: "
                             f"{-(-max(left, 0) // self.page_size)} pages)")
        while len(seq.pages) > pages_before:
            self._free.append(seq.pages.pop())
        seq.length -= num_tokens

    def free(self, seq_id: object) -> None:
        """Return the pages of `seq_id` to the free list and forget it."""
        self.sequence(seq_id)  # raises UnknownSequenceError for an unknown id
        seq = self._seqs.pop(seq_id)
        self._free.extend(reversed(seq.pages))
