"""The mathematics: formats, arithmetics, the DoRA formulas, ground truth, bounds.

Imports nothing else of the package.
"""
