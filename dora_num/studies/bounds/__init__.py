"""Notebook 03: measured error against the a-priori bounds; factored vs dense conditioning."""
