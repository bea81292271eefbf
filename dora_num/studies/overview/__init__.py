"""Notebook 00: the DoRA operator on a real model (factored vs dense norms on MiniLM)."""

NOTEBOOK = "00_overview"  # the notebook this folder backs (orders the folders; names its headline in the README)
