"""Every buffer the kernel launchers allocate is filled with NaN first (``OpConfig.poison``),
so an element a kernel fails to write shows up in the comparisons."""

import pytest

from dora_num.ops.config import override


@pytest.fixture(autouse=True)
def _poison():
    with override(poison=True):
        yield
