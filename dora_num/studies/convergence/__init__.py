"""Notebook 04: fused vs eager training, 2000 steps x 3 seeds, and its statistics."""

NOTEBOOK = "04_convergence"  # the notebook this folder backs (orders the folders; names its headline in the README)
