"""A kind bound to a library's version declares that need in its own module (`Kind.misfit`), and selection, the
software report and the manifest reader follow it with no edit to the shared `variant.py` or `manifest.py`: the
kind below, registered here only, needs the pytest it was built with."""
from __future__ import annotations

import dataclasses
from importlib import metadata
from typing import Any, Dict, Optional

import pytest

from laya_aot.kinds import registry
from laya_aot.kinds.base import Kind, Misfit
from laya_aot.kinds.usable import Here, machine_misfit, refused_for_software, reject_reason
from laya_aot.manifest import Artifact, BundleError, Needs, read_artifact
from laya_aot.padding import Ranges
from laya_aot.variant import Machine

NAME = "pytest_bound"
CPU = Machine(torch="2.13.0", cxx11_abi=True, cpu_isa="AVX512", cuda=None, gpu_arch=None, machine="x86_64",
              os="linux", python="3.11")


def _misfit(art: Artifact, m: Machine) -> Optional[Misfit]:
    """The kind's own need: the pytest its build recorded in `details.pytest`, exactly."""
    want, have = art.details["pytest"], metadata.version("pytest")
    if want == have:
        return None
    return Misfit("built with pytest %s, this process has %s: `pip install pytest==%s`" % (want, have, want))


def _check_details(details: Dict[str, Any]) -> Optional[str]:
    v = details.get("pytest")
    return None if isinstance(v, str) and v else "pytest: expected the version it was built with, got %r" % (v,)


def _unused(*args: Any) -> Any:
    raise AssertionError("not built or loaded here")


KIND = Kind(name=NAME, stage=NAME, build=_unused, load=_unused, order=5, misfit=_misfit,
            needs=lambda m, device: Needs(device="cpu"), check_details=_check_details)


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(registry._BY_NAME, NAME, KIND)  # what registry.REGISTRY would hold


def _art(pytest_version: str, **needs: Any) -> Artifact:
    return Artifact(name="%s-fp32" % NAME, kind=NAME, status="verified", device="cpu", dtype="fp32",
                    needs=Needs(device="cpu", **needs), details={"pytest": pytest_version}, path=NAME, sha256="0" * 64,
                    ranges=Ranges(1, 8, 16, 64, 2, 8))


def test_a_kind_bound_to_a_library_version_is_refused_with_its_own_reason(registered):
    here = metadata.version("pytest")
    assert reject_reason(_art(here), CPU, "cpu", "fp32") is None
    why = reject_reason(_art("0.0.1"), CPU, "cpu", "fp32")
    assert why == "built with pytest 0.0.1, this process has %s: `pip install pytest==0.0.1`" % here
    # its own reason first, alone, whatever the shared facts also say
    assert machine_misfit(_art("0.0.1", machine="aarch64"), CPU) == why
    assert machine_misfit(_art(here, machine="aarch64"), CPU) == "built for aarch64, this machine is x86_64"


def test_the_software_report_names_it_where_an_install_fixes_it(registered, monkeypatch):
    h = Here("cpu", "cpu", CPU, "fp32")
    assert [name for name, _ in refused_for_software([_art("0.0.1")], h)] == ["%s-fp32" % NAME]
    assert refused_for_software([_art("0.0.1", machine="aarch64")], h) == []   # and the machine too: not an install
    hardware = dataclasses.replace(KIND, misfit=lambda art, m: Misfit("needs a newer CPU", software=False))
    monkeypatch.setitem(registry._BY_NAME, NAME, hardware)
    assert reject_reason(_art("0.0.1"), CPU, "cpu", "fp32") == "needs a newer CPU"
    assert refused_for_software([_art("0.0.1")], h) == []


def test_the_manifest_reader_reads_its_entry_and_its_own_record(registered):
    entry = _art("0.0.1").to_dict()
    assert read_artifact(entry, registry.BY_NAME, "entry.json").details == {"pytest": "0.0.1"}
    with pytest.raises(BundleError, match="details.pytest: expected the version it was built with"):
        read_artifact(dict(entry, details={}), registry.BY_NAME, "entry.json")
