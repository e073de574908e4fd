"""AOTInductor compiler choice: never a compiler that links libstdc++ statically (the H200 load crash)."""
from __future__ import annotations

import os
import shutil

import pytest

from laya_aot.kinds import aoti, aoti_compiler


def _fake_cxx(tmp_path, name: str, prints: str) -> str:
    p = tmp_path / name
    p.write_text("#!/bin/sh\necho '%s'\n" % prints)
    p.chmod(0o755)
    return str(p)


def test_a_compiler_without_libstdcxx_so_is_passed_over(tmp_path, monkeypatch):
    # like the H200 image's /opt/gcc/bin/g++: asked for libstdc++.so it answers the bare name (not found)
    static = _fake_cxx(tmp_path, "g++-static", "libstdc++.so")
    real_lib = tmp_path / "libstdc++.so"
    real_lib.write_text("")
    dynamic = _fake_cxx(tmp_path, "g++-dynamic", str(real_lib))
    assert not aoti_compiler.links_libstdcxx_dynamically(static)
    assert aoti_compiler.links_libstdcxx_dynamically(dynamic)
    monkeypatch.setattr(aoti_compiler, "candidate_compilers", lambda configured=None: [static, dynamic])
    chosen = aoti_compiler.choose_compiler()
    assert chosen["cxx"] == dynamic
    assert "cannot link libstdc++ dynamically" in chosen["passed_over"][0]


@pytest.mark.skipif(not (shutil.which("g++") and shutil.which("readelf")), reason="needs g++ and readelf")
def test_a_wrapper_that_adds_static_libstdcxx_is_passed_over(tmp_path):
    # finds libstdc++.so, yet links it statically: only linking a test library shows it
    wrapper = tmp_path / "g++-wrapper"
    wrapper.write_text('#!/bin/sh\nexec %s -static-libstdc++ "$@"\n' % shutil.which("g++"))
    wrapper.chmod(0o755)
    assert not aoti_compiler.links_libstdcxx_dynamically(str(wrapper))
    assert aoti_compiler.links_libstdcxx_dynamically(shutil.which("g++"))


def test_missing_configured_compiler_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="aoti.cxx"):
        aoti_compiler.choose_compiler(str(tmp_path / "nope"))


def test_this_machine_has_a_usable_compiler(demo_bundle):
    from laya_aot.bundle_format import read_manifest

    (entry,) = [a for a in read_manifest(demo_bundle)["artifacts"] if a["name"] == "aoti-cpu"]
    assert os.path.exists(entry["details"]["cxx"])
    assert aoti_compiler.links_libstdcxx_dynamically(entry["details"]["cxx"])


@pytest.mark.slow  # compiles an AOTInductor package
def test_packaging_leaves_inductor_config_as_it_found_it(tmp_path):
    # aoti_compile_and_package fills aot_inductor.metadata in place; left so, it changed the FX-graph
    # cache key of the compile route's cache saved later in the same build (a miss seen on an H200)
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(x).relu()

    before = dict(torch._inductor.config.aot_inductor.metadata)
    ep = torch.export.export(Tiny(), (torch.randn(2, 4),))
    facts = aoti.package(ep, tmp_path / "pkg", ["lin.weight", "lin.bias"])
    assert facts["package_bytes"] > 0
    assert torch._inductor.config.aot_inductor.metadata == before


@pytest.mark.slow  # exports a program
@pytest.mark.parametrize("setting", ["max_autotune", "combo_kernels"])
@pytest.mark.parametrize("on", [False, True])
def test_a_package_setting_reaches_inductor_and_stays_there(tmp_path, monkeypatch, setting, on):
    # max_autotune: benchmarks/aoti_variants.py measures packages compiled with it; combo_kernels: the GPU build's
    # (a short call's forward is set by its kernel count)
    import torch

    seen = {}

    def fake_compile(ep, package_path, inductor_configs):
        seen.update(inductor_configs)
        open(package_path, "wb").write(b"pt2")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fake_compile)
    ep = torch.export.export(torch.nn.Linear(4, 3), (torch.randn(2, 4),))
    aoti.package(ep, tmp_path / "pkg", ["weight", "bias"], **{setting: on})
    assert seen.get(setting, False) is on
    assert getattr(torch._inductor.config, setting) is False   # the build's own setting does not leak out


def _build_asking(tmp_path, monkeypatch, device, fake_package):
    import types

    import torch

    from laya_aot import checkpoint

    monkeypatch.setattr(aoti, "package", fake_package)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(checkpoint, "Weights", lambda ckpt: {})
    cfg = types.SimpleNamespace(aoti=types.SimpleNamespace(cxx=None, cpu_frozen=False),
                                target=types.SimpleNamespace(name="t", arch="a"))
    added = []
    ctx = types.SimpleNamespace(device=device, dtype="fp16", cfg=cfg, ckpt=tmp_path, staging=tmp_path,
                                artifact_name=lambda kind: "aoti-x",
                                add_artifact=lambda *a, **k: added.append(k["details"]))
    exported = types.SimpleNamespace(program=None, precision=None, details=lambda: {})
    aoti.build(ctx, exported)
    return added[0]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_gpu_build_asks_for_combo_kernels_and_the_cpu_build_does_not(tmp_path, monkeypatch, device):
    asked = []

    def fake_package(program, out_dir, keys, cxx=None, frozen=False, max_autotune=False, combo_kernels=False):
        asked.append(combo_kernels)
        return {"package_bytes": 1}

    details = _build_asking(tmp_path, monkeypatch, device, fake_package)
    assert asked == [device == "cuda"]
    assert details.get("combo_kernels", False) is (device == "cuda")


def test_a_model_whose_combo_kernels_fail_to_compile_is_packaged_without_them(tmp_path, monkeypatch, caplog):
    asked = []

    def fake_package(program, out_dir, keys, cxx=None, frozen=False, max_autotune=False, combo_kernels=False):
        asked.append(combo_kernels)
        out_dir.mkdir(parents=True, exist_ok=True)
        if combo_kernels:
            (out_dir / "half-written").write_text("x")
            raise RuntimeError("InductorError: combo kernel lowering failed\nlong traceback")
        assert not (out_dir / "half-written").exists()  # the failed try's files are gone first
        return {"package_bytes": 1}

    with caplog.at_level("WARNING"):
        details = _build_asking(tmp_path, monkeypatch, "cuda", fake_package)
    assert asked == [True, False]
    assert details["combo_kernels"] is False
    assert details["combo_kernels_refused"] == "RuntimeError: InductorError: combo kernel lowering failed"
    assert "packaging without them" in caplog.text and "long traceback" not in caplog.text
