"""Notebook 06: accuracy of the magnitude gradient dg and the fine-tuning memory model."""
