"""Notebook 02: FMA contraction and square-root rounding (exact CPU study and recorded GPU data)."""

NOTEBOOK = "02_fma_and_sqrt"  # the notebook this folder backs (orders the folders; names its headline in the README)
