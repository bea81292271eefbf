"""Notebook 01: cancellation at g≈1 and collapse fractions on real adapters."""

NOTEBOOK = "01_cancellation_at_g1"  # the notebook this folder backs (orders the folders; names its headline in the README)
