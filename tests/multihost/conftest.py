"""Fixtures for the multi-host tests: four namespaced hosts (see tests/harness/netns.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dsml.testing.netns import NetnsHosts
from tests.harness.netns import Procs, hosts_fixture


@pytest.fixture
def hosts() -> Iterator[NetnsHosts]:
    """Four hosts h0..h3 (10.217.44.1-4) on one bridge, each link at 1 Gbit/s."""
    yield from hosts_fixture()


@pytest.fixture
def hosts6() -> Iterator[NetnsHosts]:
    """Four hosts h0..h3 on one bridge addressed by IPv6 only (fd00:217:44::1-4)."""
    yield from hosts_fixture(family=6)


@pytest.fixture
def procs() -> Procs:
    """Collects the events of commands a test starts on the hosts."""
    return Procs()
