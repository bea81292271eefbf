"""Notebook 06: accuracy of the magnitude gradient dg and the fine-tuning memory model."""

NOTEBOOK = "06_gradient_and_memory"  # the notebook this folder backs (orders the folders; names its headline in the README)
