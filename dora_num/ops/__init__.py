"""The operator: references, factored norm, kernels, dispatch, ``DoRALinear``."""
