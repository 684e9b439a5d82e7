"""Shared fixtures (plain helpers — the tiny-model builder, the χ² test, engine drivers — are in
tests/helpers.py)."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two xdist workers on a 2-core machine: one torch thread each, or the
    # workers' thread pools would spin-wait against each other.
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tiny-model tests on one torch thread, then restore the setting.

    Tiny forwards are dominated by per-op overhead; on a busy 2-core machine thread spin-waiting
    made them ~200× slower.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(items):
    """Record each test's tier in the JUnit report (scripts/test_durations.py sums by tier)."""
    for item in items:
        item.user_properties.append(("tier", "slow" if item.get_closest_marker("slow") else "unit"))
