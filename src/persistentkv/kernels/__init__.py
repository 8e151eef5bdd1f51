"""Triton jit code only: the math helpers, the paged decode kernel and the merge kernel."""
