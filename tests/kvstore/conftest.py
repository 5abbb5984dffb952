"""Fixtures of the kvstore tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(params=[torch.float32, torch.bfloat16, torch.float16], ids=str)
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return request.param
