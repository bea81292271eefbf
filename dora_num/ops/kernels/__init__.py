"""Triton kernels: the fused compose forward/backward, the norm's row sums of squares, tail and
assembly; ``_common``: what their launchers share (the output allocator, the row-block prologue)."""
