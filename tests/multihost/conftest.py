"""Fixtures for multi-host tests: namespace hosts (tests/multihost/netns.py), skipped where none can be made."""

from __future__ import annotations

import pytest

from tests.multihost import netns


@pytest.fixture
def two_hosts():
    """Two namespace hosts on one bridge, removed after the test (also after a failure)."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    with netns.hosts(2) as pair:
        yield pair
