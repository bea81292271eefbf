"""The operator: its switches (:mod:`.config`), references, factored norm, kernels, dispatch, ``DoRALinear``."""
