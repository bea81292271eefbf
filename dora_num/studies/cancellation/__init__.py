"""Notebook 01: cancellation at g≈1 and collapse fractions on real adapters."""
