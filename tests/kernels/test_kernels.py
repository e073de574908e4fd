"""laya_aot.kernels: the catalogue equals what laya's FastLaya requests; cross-compiles; loads without JIT.

CPU only. The catalogue proof drives the real `laya.fast.FastLaya` with the five
`laya.tl_kernels` factories replaced by recorders that return no-op kernels: its constructor
and its forward (the padding policy, the per-shape attention choice) then run unchanged, on
the meta device for large configs (no weights are materialised) and on CPU for a real demo
checkpoint. The compile and load tests need TileLang (the `tilelang` extra) and nvcc.
"""
from __future__ import annotations

import inspect
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from laya_aot.kernels.catalogue import (
    _REQUIRED,
    FACTORIES,
    KernelSpec,
    catalogue,
    factory_signatures,
    row_buckets,
    static_lengths,
)
from tests.bench_scripts.conftest import load_script

try:
    import tilelang  # noqa: F401

    HAVE_TILELANG, NO_TILELANG = True, ""
except Exception as _e:  # not installed, or installed but broken
    HAVE_TILELANG, NO_TILELANG = False, "tilelang is not importable (%s); pip install -e '.[tilelang]'" % _e
needs_tilelang = pytest.mark.skipif(not HAVE_TILELANG, reason=NO_TILELANG)


def _nvcc_available() -> bool:
    if not HAVE_TILELANG:
        return False
    from laya_aot.kernels.cross_compile import find_nvcc

    try:
        find_nvcc()
        return True
    except RuntimeError:
        return False


needs_nvcc = pytest.mark.skipif(not _nvcc_available(), reason=NO_TILELANG or "no nvcc: install the CUDA toolkit "
                                "or `pip install nvidia-cuda-nvcc>=13`, or set CUDA_HOME")

LARGE = dict(vocab_size=50368, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
             intermediate_size=2624, local_attention=128, global_attn_every_n_layers=3)
BASE = dict(vocab_size=50368, hidden_size=768, num_hidden_layers=22, num_attention_heads=12,
            intermediate_size=1152, local_attention=128, global_attn_every_n_layers=3)
ODD = dict(vocab_size=50368, hidden_size=96, num_hidden_layers=4, num_attention_heads=3, intermediate_size=160,
           local_attention=32, global_attn_every_n_layers=2, norm_eps=1e-6)


# ------------------------------------------------------------------------------------ recording FastLaya
class Recorder:
    """Stands in for the five factories: records each call, returns a kernel that does nothing."""

    def __init__(self, monkeypatch):
        from laya import tl_kernels

        self.calls = []
        for name in FACTORIES:
            monkeypatch.setattr(tl_kernels, name, self._factory(name))

    def _factory(self, name):
        def factory(*args, **kwargs):
            self.calls.append(KernelSpec.of(name, *args, **kwargs))
            return lambda *a, **k: None
        return factory


def _meta_model(encoder_kwargs, head_layers=2):
    from laya.common import DecisionModel
    from transformers import AutoModel, ModernBertConfig

    cfg = ModernBertConfig(**encoder_kwargs)
    with torch.device("meta"):
        enc = AutoModel.from_config(cfg, attn_implementation="sdpa")
        model = DecisionModel(enc, head_layers, 3)
    return model, cfg


def _sweep(max_len, max_rows):
    """Row counts hitting every power-of-two bucket from both sides, token counts at every bucket edge."""
    rows = sorted({n for b in row_buckets(max_rows) for n in (b // 2 + 1, b) if 1 <= n <= max_rows} | {1, max_rows})
    edges = {1, max_len}
    for L in list(range(16, 257, 16)) + list(range(320, max_len + 64, 64)):
        edges |= {L - 1, L, L + 1}
    return rows, sorted(t for t in edges if 1 <= t <= max_len)


def _drive(fast, rows, tokens, device):
    for n in rows:
        for t in tokens:
            ids = torch.ones(n, t, dtype=torch.long, device=device)
            mask = torch.ones(n, t, dtype=torch.long, device=device)
            mpos = torch.zeros(n, 3, dtype=torch.long, device=device)
            mmask = torch.ones(n, 3, dtype=torch.bool, device=device)
            fast.forward(ids, mask, mpos, mmask, torch.zeros(n, dtype=torch.long, device=device))


@needs_tilelang   # laya.fast imports laya.tl_kernels, which imports tilelang
@pytest.mark.parametrize("name,encoder,max_len,max_rows,dtype", [
    ("large-1024", LARGE, 1024, 64, torch.bfloat16),
    ("large-512-fp16", LARGE, 512, 64, torch.float16),
    ("base-1024-rows24", BASE, 1024, 24, torch.bfloat16),
    ("odd-head-dim-eps", ODD, 300, 8, torch.bfloat16),   # head dim 32, head attn 1x96, max_len off the 64 grid
])
@pytest.mark.slow  # drives FastLaya over every shape of a large model: 5-20 s each
def test_catalogue_is_exactly_what_fastlaya_requests(monkeypatch, name, encoder, max_len, max_rows, dtype):
    from laya.fast import FastLaya

    rec = Recorder(monkeypatch)
    model, cfg = _meta_model(encoder)
    fast = FastLaya(model, max_len=max_len, use_graphs=False, dtype=dtype)
    rows, tokens = _sweep(max_len, max_rows)
    _drive(fast, rows, tokens, "meta")
    expected = catalogue(cfg.to_dict(), "bf16" if dtype == torch.bfloat16 else "fp16", max_len, max_rows)
    assert len(set(expected)) == len(expected)
    assert set(rec.calls) == set(expected)


@pytest.mark.slow  # makes a checkpoint and drives FastLaya over 70 shapes: about 10 s
@needs_tilelang
def test_catalogue_matches_a_real_demo_checkpoint_on_cpu(monkeypatch, tmp_path):
    """Same proof on real weights loaded by laya.load (tiny-alt: context 384, so static buckets exist)."""
    import laya
    from laya.fast import FastLaya

    from laya_aot.demo import make_checkpoint
    from laya_aot.kernels.cross_compile import checkpoint_catalogue

    ckpt = make_checkpoint(tmp_path / "tiny-alt", "tiny-alt")
    agent = laya.load(str(ckpt), device="cpu")
    rec = Recorder(monkeypatch)
    # tiny-alt states amp_dtype fp16, so laya's fast path runs it in fp16: the catalogue's default dtype
    fast = FastLaya(agent.model, max_len=agent.cfg["max_len"], use_graphs=False, dtype=torch.float16)
    _drive(fast, [1, 2, 3, 5, 8, 9, 16], [1, 16, 17, 255, 256, 257, 320, 321, 383, 384], "cpu")
    expected = checkpoint_catalogue(ckpt, max_rows=16)
    assert set(rec.calls) == set(expected)
    assert any(s.kwargs.get("L") == 384 and s.kwargs.get("B") == 16 for s in expected)


def test_catalogue_shape_rules():
    assert row_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert row_buckets(48) == [1, 2, 4, 8, 16, 32, 64]
    assert static_lengths(1024) == list(range(320, 1025, 64))
    assert static_lengths(256) == []
    assert static_lengths(300) == [300]
    specs = catalogue(dict(LARGE, model_type="modernbert"), "bf16", 1024, 64)
    # 11 fixed + RoPE + 2 dynamic attention + 12 lengths x 7 row buckets x 2 windows; the head's
    # attention (16 heads x 64) is the global encoder attention and is not duplicated.
    assert len(specs) == 11 + 1 + 2 + 12 * 7 * 2
    keys = [s.key for s in specs]
    assert len(set(keys)) == len(keys)
    assert keys == [s.key for s in catalogue(dict(LARGE), "bf16", 1024, 64)]   # stable
    assert all(set(k) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_+") for k in keys)


@needs_tilelang
def test_signatures_read_from_source_match_the_factories():
    from laya import tl_kernels

    for name, params in factory_signatures().items():
        sig = getattr(tl_kernels, name).signature
        assert [p.name for p in params] == list(sig.parameters)
        for p in params:
            want = sig.parameters[p.name]
            assert p.kw_only == (want.kind is inspect.Parameter.KEYWORD_ONLY)
            if want.default is inspect.Parameter.empty:
                assert p.default is _REQUIRED
            else:
                assert p.default == want.default and type(p.default) is type(want.default)


# ------------------------------------------------------------------------------------ compile + load
@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    """The tiny demo's catalogue cross-compiled for sm_90a and sm_86 (about 90 s on 2 cores)."""
    from laya_aot.demo import make_checkpoint
    from laya_aot.kernels import build_for_checkpoint

    root = tmp_path_factory.mktemp("kernels")
    ckpt = make_checkpoint(root / "tiny", "tiny")
    out = root / "bundle"
    # the tiny demo has no amp_dtype: laya serves it in fp16 on these GPUs, the catalogue's default too
    reports = build_for_checkpoint(ckpt, ["sm_90a", "sm_86"], "fp16", 256, 64, out, progress=False)
    return ckpt, out, reports


@needs_tilelang
@needs_nvcc
def test_cross_compile_demo_every_kernel_hashed(tiny_build):
    from laya_aot.files import sha256_file
    from laya_aot.kernels.cross_compile import checkpoint_catalogue

    ckpt, out, reports = tiny_build
    want = [s.key for s in checkpoint_catalogue(ckpt)]
    for arch, rep in reports.items():
        assert rep["arch"] == arch and rep["tilelang_version"] and rep["nvcc_version"]
        assert [k["key"] for k in rep["kernels"]] == want
        for k in rep["kernels"]:
            assert k["status"] == "ok", (arch, k["key"], k["error"])
            lib, meta = out / arch / k["path"], out / arch / k["meta_path"]
            assert k["size"] == lib.stat().st_size > 0
            assert sha256_file(lib) == k["sha256"] and sha256_file(meta) == k["meta_sha256"]
            assert json.loads(meta.read_text())["arch"] == arch
        assert json.loads((out / arch / "kernels.json").read_text())["kernels"] == rep["kernels"]


@pytest.mark.slow  # compiles TileLang kernels
@needs_tilelang
@needs_nvcc
def test_failed_kernel_is_recorded_and_the_rest_go_on(tmp_path):
    from laya_aot.kernels import compile_catalogue

    good = KernelSpec.of("add_ln_kernel", 64, dtype="bfloat16")
    bad_lowering = KernelSpec.of("gemm_kernel", 64, 64, threads=7, dtype="bfloat16")   # no valid warp layout
    bad_nvcc = KernelSpec.of("attn_kernel", None, None, 2, 8, dtype="bfloat16")       # head dim 8: no mma shape
    rep = compile_catalogue([bad_lowering, good, bad_nvcc], "sm_86", tmp_path, jobs=2, progress=False)
    by_key = {k["key"]: k for k in rep["kernels"]}
    assert by_key[good.key]["status"] == "ok" and by_key[good.key]["sha256"]
    for bad in (bad_lowering, bad_nvcc):
        assert by_key[bad.key]["status"] == "failed" and by_key[bad.key]["path"] is None
    assert "warp partition" in by_key[bad_lowering.key]["error"]
    nvcc_error = by_key[bad_nvcc.key]["error"]
    assert "error" in nvcc_error.splitlines()[0] and "--- compiler output (tail) ---" in nvcc_error
    assert rep["ok"] == 1 and rep["failed"] == 2


@pytest.mark.slow  # compiles a TileLang kernel
@needs_tilelang
@needs_nvcc
def test_kernel_cache_reuses_a_compiled_kernel_and_ignores_a_bad_entry(tmp_path, monkeypatch):
    from laya_aot.kernels import compile_catalogue

    spec = KernelSpec.of("add_ln_kernel", 96, dtype="bfloat16")
    monkeypatch.setenv("LAYA_AOT_KERNEL_CACHE", str(tmp_path / "cache"))
    first = compile_catalogue([spec], "sm_86", tmp_path / "a", jobs=1, progress=False)
    again = compile_catalogue([spec], "sm_86", tmp_path / "b", jobs=1, progress=False)
    assert (first["from_cache"], again["from_cache"]) == (0, 1)
    assert again["kernels"][0]["sha256"] == first["kernels"][0]["sha256"]
    path_a, path_b = tmp_path / "a" / first["kernels"][0]["path"], tmp_path / "b" / again["kernels"][0]["path"]
    assert path_b.read_bytes() == path_a.read_bytes()
    # an entry whose metadata names another kernel is not trusted: the kernel is compiled again
    meta = Path(again["cache"]) / (spec.key + ".json")
    meta.write_text(json.dumps(dict(json.loads(meta.read_text()), key="other")))
    third = compile_catalogue([spec], "sm_86", tmp_path / "c", jobs=1, progress=False)
    assert third["from_cache"] == 0 and third["kernels"][0]["status"] == "ok"
    monkeypatch.setenv("LAYA_AOT_KERNEL_CACHE", "0")
    off = compile_catalogue([spec], "sm_86", tmp_path / "d", jobs=1, progress=False)
    assert off["cache"] is None and off["from_cache"] == 0


def _strip_nvcc(monkeypatch):
    """No nvcc reachable: PATH without it, and TileLang's CUDA home (resolved at its import) emptied."""
    import importlib

    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and not shutil.which("nvcc", path=p)]
    monkeypatch.setenv("PATH", os.pathsep.join(path))
    monkeypatch.setattr(importlib.import_module("tilelang.contrib.nvcc"), "CUDA_HOME", "")
    assert shutil.which("nvcc") is None


def _forget_jit_caches():
    """Drop kernels earlier tests put in the factories' in-memory caches (one arch per process)."""
    from laya import tl_kernels

    for name in FACTORIES:
        impl = getattr(tl_kernels, name)
        impl._kernel_cache.clear()
        impl._call_form_cache.clear()


@needs_tilelang
@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_90a", "sm_86"])
def test_runtime_uses_only_bundle_kernels_and_never_compiles(tiny_build, monkeypatch, arch):
    import laya

    from laya_aot.kernels import KernelMissing, make_fast_forward
    from laya_aot.kernels.driver import active
    jit_guard = load_script("jit_guard").jit_guard

    ckpt, out, reports = tiny_build
    _strip_nvcc(monkeypatch)
    _forget_jit_caches()
    agent = laya.load(str(ckpt), device="cpu")
    agent.dtype = torch.float16   # what laya serves the tiny demo (no amp_dtype) in on a GPU
    with jit_guard(forbid=True) as attempts:
        fast = make_fast_forward(agent, out, arch, reports[arch]["kernels"], use_graphs=False)
        for n, t in [(1, 1), (64, 256), (3, 100), (200, 256)]:
            fast.check(n, t)   # up to 256 tokens the dynamic kernels serve any row count
        f = fast.fast
        with active(fast.bundle):   # as PrecompiledFast.forward calls them
            kernels = [f.k_qkv, f.k_o, f.k_geglu, f.k_o2, f.k_addln, f.k_addln_b, f.k_ln_b, f.k_in, f.k_out, f.k_ffn1,
                       f.k_ffn2, f.rope_k(), f.attn_k(4, 64, 0), f.attn_k(4, 64, 32), f.attn_k_head(4, 64)]
        assert fast.wait_preloaded(120)   # the kernels construction did not need, loaded in the background
    assert sum(attempts.values()) == 0, dict(attempts)
    libs = {Path(k.adapter.libpath).resolve() for k in kernels}
    bundle_libs = {(out / arch / e["path"]).resolve() for e in reports[arch]["kernels"]}
    assert libs == bundle_libs   # all 15 kernels FastLaya holds are the bundle's, and it uses all of them
    assert len(fast.bundle.loaded) == len(bundle_libs) and fast.stats["background_failed"] == {}
    assert fast.stats["kernels_at_construction"] == 11   # the fixed kernels; rope and attention on first need
    with pytest.raises(KernelMissing, match="max_len"):
        fast.check(1, 300)


@needs_tilelang
@needs_nvcc
def test_runtime_refuses_missing_or_altered_kernels(tiny_build, monkeypatch, tmp_path):
    import laya

    from laya_aot.kernels import BundleError, KernelMissing, make_fast_forward
    from laya_aot.kernels.driver import active
    guard = load_script("jit_guard")
    JITForbidden, jit_guard = guard.JITForbidden, guard.jit_guard

    ckpt, out, reports = tiny_build
    _strip_nvcc(monkeypatch)
    agent = laya.load(str(ckpt), device="cpu")
    agent.dtype = torch.float16
    entries = reports["sm_86"]["kernels"]
    _forget_jit_caches()
    with jit_guard(forbid=True) as attempts:
        with pytest.raises(KernelMissing, match="gemm_geglu_kernel"):
            make_fast_forward(agent, out, "sm_86", [e for e in entries if e["factory"] != "gemm_geglu_kernel"],
                              use_graphs=False)
        copy = tmp_path / "sm_86"
        shutil.copytree(out / "sm_86", copy)
        victim = next(e for e in entries if e["factory"] == "rope_kernel")
        with open(copy / victim["path"], "ab") as f:
            f.write(b"\0")
        _forget_jit_caches()
        # not a kernel construction needs: the background preload records it, and the call that needs it raises
        fast = make_fast_forward(agent, copy, "sm_86", entries, use_graphs=False)
        assert fast.wait_preloaded(120)
        assert "sha256" in fast.stats["background_failed"][victim["key"]]
        with pytest.raises(BundleError, match="sha256"), active(fast.bundle):
            fast.fast.rope_k()
        # and the guard itself bites: a factory miss with no bundle active would compile
        from laya import tl_kernels
        with pytest.raises(JITForbidden):
            tl_kernels.gemm_kernel(32, 32, dtype="bfloat16")
    assert attempts["JITImpl.compile"] == 1


def test_select_arch():
    from laya_aot.kernels import arch_of, select_arch

    assert arch_of((9, 0)) == "sm_90a" and arch_of((8, 6)) == "sm_86"
    built = ["sm_80", "sm_86", "sm_89", "sm_90a"]
    assert select_arch(built, (9, 0)) == "sm_90a"
    assert select_arch(built, (8, 7)) == "sm_86"
    assert select_arch(["sm_80"], (8, 9)) == "sm_80"
    assert select_arch(["sm_90a"], (10, 0)) is None
    assert select_arch(["sm_86"], (8, 0)) is None
