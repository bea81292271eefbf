"""Notebook 05: memory and speed of the operator (GPU benchmarks and their report)."""
