"""The frozen CPU package's library, shipped out of its zip: what the build refuses to unpack, where it loads."""
from __future__ import annotations

import zipfile

import pytest

from laya_aot.kinds import aoti


def _package(where, members):
    with zipfile.ZipFile(where / aoti.PACKAGE, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, data)


def test_the_one_library_replaces_the_package(tmp_path):
    _package(tmp_path, {"model/data/aotinductor/model/x.wrapper.so": b"\x7fELF" + b"x" * 100,
                        "model/data/aotinductor/model/x.wrapper.cpp": b"int main(){}"})
    aoti.unpack_library(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [aoti.LIBRARY]
    assert (tmp_path / aoti.LIBRARY).read_bytes() == b"\x7fELF" + b"x" * 100


@pytest.mark.parametrize("libs", [0, 2])
def test_a_package_without_exactly_one_library_is_refused_and_kept(tmp_path, libs):
    _package(tmp_path, {"model/a%d.so" % i: b"x" for i in range(libs)} | {"model/a.cpp": b""})
    with pytest.raises(RuntimeError, match="aoti.cpu_frozen=false"):
        aoti.unpack_library(tmp_path)
    assert (tmp_path / aoti.PACKAGE).exists() and not (tmp_path / aoti.LIBRARY).exists()


def test_an_unpacked_library_is_not_opened_for_a_gpu(tmp_path):
    (tmp_path / aoti.LIBRARY).write_bytes(b"not opened")
    with pytest.raises(RuntimeError, match="only on the CPU"):
        aoti.load_aoti(tmp_path, device_index=0)
