"""Notebook 05: memory and speed of the operator (GPU benchmarks and their report)."""

NOTEBOOK = "05_memory_and_speed"  # the notebook this folder backs (orders the folders; names its headline in the README)
