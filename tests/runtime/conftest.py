"""Fixtures of the runtime's tests."""
from __future__ import annotations

import pytest


@pytest.fixture
def probe_starts(monkeypatch) -> list:
    """Every probe child `probe.begin` starts from now on (its `Pending`), in order."""
    from laya_aot import probe

    started: list = []
    real_begin = probe.begin

    def recording_start(*a, **k):
        started.append(real_begin(*a, **k))
        return started[-1]
    monkeypatch.setattr(probe, "begin", recording_start)
    return started
