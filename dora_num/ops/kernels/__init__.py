"""Triton kernels (fused compose forward/backward, norm assembly)."""
