"""The project's Jupyter kernel ``dora-num``: the kernelspec the notebooks name.

Every notebook's ``metadata.kernelspec`` is :data:`KERNELSPEC`, so JupyterLab opens
it on this environment's Python and plain ``papermill NB OUT`` (no ``-k``) runs it
there too.  :func:`ensure_kernelspec` installs the spec into ``sys.prefix`` (what
``make venv`` does with ``ipykernel install --sys-prefix``) when it is missing or
points at another interpreter, so a fresh environment needs no manual step.
"""

from __future__ import annotations

import sys
from pathlib import Path

KERNEL_NAME = "dora-num"
KERNELSPEC = {"name": KERNEL_NAME, "display_name": "Python (dora-num)", "language": "python"}


def notebook_kernel(nb: Path) -> str:
    """The kernel name a notebook asks for (its ``metadata.kernelspec.name``)."""
    import nbformat

    spec = nbformat.read(nb, as_version=4).metadata.get("kernelspec") or {}
    return spec.get("name") or KERNEL_NAME


def _spec_python(name: str) -> Path | None:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        argv = KernelSpecManager().get_kernel_spec(name).argv
    except NoSuchKernel:
        return None
    return Path(argv[0])


def ensure_kernelspec(name: str = KERNEL_NAME) -> None:
    """Make ``name`` resolve to this interpreter (only the project's own kernel is installed)."""
    if name != KERNEL_NAME:
        return
    py = _spec_python(name)
    if py is not None and py.is_absolute() and py.parent.absolute() == Path(sys.executable).parent.absolute():
        return
    from ipykernel.kernelspec import install

    install(kernel_name=KERNEL_NAME, display_name=KERNELSPEC["display_name"], prefix=sys.prefix)
