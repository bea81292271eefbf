"""The code behind the notebooks, one folder per question (docs/design.md):
``overview`` (00), ``cancellation`` (01), ``fma`` (02), ``bounds`` (03),
``convergence`` (04), ``speed`` (05), ``gradient`` (06); each folder's analysis sits
beside the code that records its data, and its figures in its ``plots.py``.

Beside them: ``inputs`` (the named, seeded input regimes), ``recorded`` (the
recorded-data contract), ``cli`` (``dora-num record NAME``), ``suite`` (the GPU
suite's driver), ``bench`` (timing helpers), ``carry`` (MiniLM for the GPU machine).
"""
