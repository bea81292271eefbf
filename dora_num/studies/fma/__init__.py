"""Notebook 02: FMA contraction and square-root rounding (exact CPU study and recorded GPU data)."""
