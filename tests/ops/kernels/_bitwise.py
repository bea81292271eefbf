"""Bit-level comparison shared by the CPU (interpreter) and GPU kernel tests."""

import torch


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    diff = int((_bits(a) != _bits(b)).sum())
    assert diff == 0, f"{diff} of {a.numel()} elements differ in their bits"
