"""Notebook 03: measured error against the a-priori bounds; factored vs dense conditioning."""

NOTEBOOK = "03_ground_truth_and_bounds"  # the notebook this folder backs (orders the folders; names its headline in the README)
