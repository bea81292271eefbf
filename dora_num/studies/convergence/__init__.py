"""Notebook 04: fused vs eager training, 2000 steps x 3 seeds, and its statistics."""
