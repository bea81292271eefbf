"""Notebook 00: the DoRA operator on a real model (factored vs dense norms on MiniLM)."""
