"""The TileLang driver's kernel loading off the first answer's path (`PrecompiledFast`, `Preload`): construction
loads only what FastLaya's constructor asks for, a call what its shape needs, and the rest loads in a background
thread, between calls.

CPU only, no nvcc: laya's real FastLaya runs on a demo checkpoint on the CPU with the five `laya.tl_kernels`
factories replaced by stand-ins that behave as TileLang's JIT factories do (a per-factory cache, `compile` on a
miss: the method the driver hooks), and a KernelBundle whose `_load_entry` hands back a kernel that does nothing
instead of dlopening a library. What only a GPU shows (the real load times, that a background load never disturbs a
CUDA graph capture) is not proven here.
"""
from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

pytest.importorskip("tilelang", reason="laya.fast imports tilelang: pip install -e '.[tilelang]'")

from laya_aot.kernels import driver  # noqa: E402 - after the skip
from laya_aot.kernels.catalogue import FACTORIES, KernelSpec  # noqa: E402
from laya_aot.kernels.cross_compile import checkpoint_catalogue  # noqa: E402
from laya_aot.manifest import BundleError  # noqa: E402


class StandInFactory:
    """A `laya.tl_kernels` factory as TileLang's JITImpl behaves: its own cache, `compile` on a miss."""

    def __init__(self, name):
        self.name, self.cache = name, {}

    def __call__(self, *args, **kwargs):
        key = KernelSpec.of(self.name, *args, **kwargs).key
        if key not in self.cache:
            self.cache[key] = self.compile(*args, **kwargs)
        return self.cache[key]

    def compile(self, *args, **kwargs):
        raise AssertionError("%s would JIT-compile: no bundle was active" % self.name)


class FakeBundle(driver.KernelBundle):
    """Loads a kernel that does nothing, after `delay` seconds; records where and how each load ran."""

    def __init__(self, tmp_path, specs, delay=0.0, broken=()):
        super().__init__(tmp_path, "sm_90a", [dict(s.to_json(), key=s.key, status="ok") for s in specs])
        self.delay, self.broken = delay, set(broken)
        self.order, self.where = [], {}
        self.loaded_some = threading.Event()

    def _load_entry(self, entry):
        key = entry["key"]
        self.where[key] = (threading.current_thread().name, driver._ACTIVE.get() is self)
        time.sleep(self.delay)
        if key in self.broken:
            raise BundleError("kernel file %s/%s does not match its sha256 in the manifest" % (self.dir, key))
        self.order.append(key)
        if len(self.order) >= 20:
            self.loaded_some.set()
        return lambda *a, **k: None


@pytest.fixture
def stand_ins(monkeypatch):
    from laya import tl_kernels

    for name in FACTORIES:
        monkeypatch.setattr(tl_kernels, name, StandInFactory(name))


@pytest.fixture(scope="module")
def agent(alt_ckpt):
    """tiny-alt: context 384, so its catalogue has shape-specific attention kernels (57 in all, 11 for construction)."""
    import laya

    agent = laya.load(str(alt_ckpt), device="cpu")
    agent.dtype = torch.float16   # what laya serves tiny-alt (amp_dtype fp16) in on a GPU, the catalogue's too
    return agent


@pytest.fixture(scope="module")
def specs(alt_ckpt):
    return checkpoint_catalogue(alt_ckpt, max_rows=64)


def _call(fast, rows, tokens):
    ids = torch.ones(rows, tokens, dtype=torch.long)
    return fast.forward(ids, torch.ones_like(ids), torch.zeros(rows, 3, dtype=torch.long),
                        torch.ones(rows, 3, dtype=torch.bool), torch.zeros(rows, dtype=torch.long))


def test_the_first_answer_pays_only_for_its_kernels_and_the_rest_load_in_the_background(stand_ins, agent, specs,
                                                                                        tmp_path, caplog):
    bundle = FakeBundle(tmp_path, specs, delay=0.01)
    caplog.set_level(logging.INFO, logger=driver.__name__)
    fast = driver.PrecompiledFast(agent, bundle, use_graphs=False)
    at_construction = fast.stats["kernels_at_construction"]
    assert 0 < at_construction < len(specs) // 3 and fast.stats["kernels"] == len(specs)
    assert all(bundle.where[k][0] != "laya-aot-tilelang-preload" for k in bundle.order[:at_construction])
    _call(fast, 3, 40)
    first = fast.stats["kernels_before_first_answer"]
    assert at_construction < first < len(specs) // 2   # the call's rope and attention kernels, on demand
    assert fast.wait_preloaded(60)
    st = fast.stats
    assert st["background"] == "done" and st["background_failed"] == {} and st["background_s"] > 0
    assert set(bundle.loaded) == {s.key for s in specs} and len(bundle.order) == len(specs)   # each loaded once
    assert st["background_kernels"] == len(bundle.loaded_in_background) == len(specs) - first
    # every background load ran in the preload thread with the bundle active there, every other in the caller's
    for key, (thread, active_there) in bundle.where.items():
        assert (thread == "laya-aot-tilelang-preload") == (key in bundle.loaded_in_background) and active_there
    assert "the others load in the background" in caplog.text
    assert "%d were loaded before the first answer" % first in caplog.text
    _call(fast, 64, 256)   # every kernel is there now: a call loads nothing and compiles nothing
    assert len(bundle.order) == len(specs)


def test_a_kernel_that_fails_in_the_background_fails_the_call_that_needs_it_and_nothing_else(stand_ins, agent, specs,
                                                                                             tmp_path, caplog):
    from laya import tl_kernels

    rope = next(s for s in specs if s.factory == "rope_kernel")   # not needed before the first call
    bundle = FakeBundle(tmp_path, specs, broken={rope.key})
    fast = driver.PrecompiledFast(agent, bundle, use_graphs=False)
    assert fast.wait_preloaded(60)
    st = fast.stats
    assert st["background"] == "done" and list(st["background_failed"]) == [rope.key]
    assert "BundleError: kernel file" in st["background_failed"][rope.key]
    assert "failed to load in the background" in caplog.text
    assert len(bundle.loaded) == len(specs) - 1 and fast.preload.thread.is_alive() is False
    with pytest.raises(BundleError, match="does not match its sha256"):   # as a load on demand raises it
        _call(fast, 2, 16)
    with pytest.raises(BundleError, match="does not match its sha256"):   # and again: a failure is not cached
        with driver.active(bundle):
            tl_kernels.rope_kernel(**rope.kwargs)
    assert rope.key not in tl_kernels.rope_kernel.cache


def test_a_call_takes_its_turn_before_the_next_background_load(stand_ins, agent, specs, tmp_path):
    """A caller waits for the background load in flight (one kernel), never for the queue: no starvation on the
    bundle's lock, and no background load overlaps a call (its CUDA graph capture on a GPU)."""
    bundle = FakeBundle(tmp_path, specs, delay=0.02)
    fast = driver.PrecompiledFast(agent, bundle, use_graphs=False)
    assert bundle.loaded_some.wait(60)
    overlaps = []
    real = fast.fast.forward

    def watched(*a, **k):   # inside the call: the background must not be loading
        overlaps.append(bundle._background_busy)
        time.sleep(0.1)
        overlaps.append(bundle._background_busy)
        return real(*a, **k)
    fast.fast.forward = watched
    big = max(specs, key=lambda s: (s.factory == "attn_kernel", s.kwargs.get("L") or 0, s.kwargs.get("B") or 0))
    assert big.key not in bundle.loaded
    before = len(bundle.order)
    _call(fast, big.kwargs["B"], big.kwargs["L"])   # needs kernels the background has not reached
    assert big.key in bundle.loaded and big.key not in bundle.loaded_in_background
    assert bundle.order.index(big.key) - before <= 3   # at most the load in flight came first
    assert overlaps == [False, False]
    assert fast.wait_preloaded(60) and fast.stats["background"] == "done"


def test_close_stops_the_background_after_the_kernel_in_flight(stand_ins, agent, specs, tmp_path):
    bundle = FakeBundle(tmp_path, specs, delay=0.02)
    fast = driver.PrecompiledFast(agent, bundle, use_graphs=False)
    assert bundle.loaded_some.wait(60)
    fast.close()
    assert fast.wait_preloaded(10)
    assert fast.stats["background"] == "stopped" and len(bundle.loaded) < len(specs)
    _call(fast, 2, 16)   # calls still load what they need on demand
    assert driver._RUNNING == set() or all(p.bundle is not bundle for p in driver._RUNNING)


def test_without_preload_only_what_is_needed_ever_loads(stand_ins, agent, specs, tmp_path):
    bundle = FakeBundle(tmp_path, specs)
    fast = driver.PrecompiledFast(agent, bundle, use_graphs=False, preload=False)
    _call(fast, 2, 16)
    assert fast.preload is None and fast.stats["preload"] == "off" and fast.wait_preloaded(0)
    assert len(bundle.loaded) == fast.stats["kernels_before_first_answer"] < len(specs) // 3
