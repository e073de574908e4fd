"""AOTInductor compiler choice: never a compiler that links libstdc++ statically (the H200 load crash)."""
from __future__ import annotations

import os
import shutil

import pytest

from laya_aot.build import aoti


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
    assert not aoti.links_libstdcxx_dynamically(static)
    assert aoti.links_libstdcxx_dynamically(dynamic)
    monkeypatch.setattr(aoti, "candidate_compilers", lambda configured=None: [static, dynamic])
    chosen = aoti.choose_compiler()
    assert chosen["cxx"] == dynamic
    assert "cannot link libstdc++ dynamically" in chosen["passed_over"][0]


@pytest.mark.skipif(not (shutil.which("g++") and shutil.which("readelf")), reason="needs g++ and readelf")
def test_a_wrapper_that_adds_static_libstdcxx_is_passed_over(tmp_path):
    # finds libstdc++.so, yet links it statically: only linking a test library shows it
    wrapper = tmp_path / "g++-wrapper"
    wrapper.write_text('#!/bin/sh\nexec %s -static-libstdc++ "$@"\n' % shutil.which("g++"))
    wrapper.chmod(0o755)
    assert not aoti.links_libstdcxx_dynamically(str(wrapper))
    assert aoti.links_libstdcxx_dynamically(shutil.which("g++"))


def test_missing_configured_compiler_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="aoti.cxx"):
        aoti.choose_compiler(str(tmp_path / "nope"))


def test_this_machine_has_a_usable_compiler(demo_bundle):
    from laya_aot.manifest import read_manifest

    (entry,) = [a for a in read_manifest(demo_bundle)["artifacts"] if a["name"] == "aoti-cpu"]
    assert os.path.exists(entry["details"]["cxx"])
    assert aoti.links_libstdcxx_dynamically(entry["details"]["cxx"])
