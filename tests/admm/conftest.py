"""Fixtures of the pure-core tests."""
from __future__ import annotations

import pytest

from elsa_ds.admm.kernels import build


@pytest.fixture(scope="module")
def kernels():
    k = build.load()
    if k is None:
        pytest.skip("the fused kernels could not be built here (no C++ compiler?)")
    return k
