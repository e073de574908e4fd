"""Build variants: one string that names exactly what an artifact needs from a machine.

Modelled on huggingface/kernels' `torch211-cxx11-cu130-x86_64-linux`. An artifact records its
variant string and the same facts as fields; the runtime computes the machine's facts and says,
field by field, why an artifact does not fit.
"""
from __future__ import annotations

import functools
import platform
import sys
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Dict, Optional

if TYPE_CHECKING:
    from .manifest import Needs

# CPU instruction sets in the order torch reports them; a package built for one needs at least it.
ISA_ORDER = ("DEFAULT", "ZVECTOR", "VSX", "SVE256", "AVX2", "AVX512")


@dataclass(frozen=True)
class Machine:
    """What this process can run: torch build, C++ ABI, CPU ISA, CUDA runtime and GPU arch."""

    torch: str
    cxx11_abi: bool
    cpu_isa: str
    cuda: Optional[str]
    gpu_arch: Optional[str]
    machine: str
    os: str
    python: str
    # what a precompiled function is bound to (`Needs.torch_build` ...); None where unknown or not applicable
    torch_build: Optional[str] = None
    python_build: Optional[str] = None
    triton: Optional[str] = None
    gpu_name: Optional[str] = None
    # `traced_packages()`; None: read when an artifact asks (package metadata: 3 ms after torch, 65 ms bare)
    traced_packages: Optional[str] = None

    def as_dict(self) -> Dict[str, object]:
        return asdict(self)


def torch_tag(version: str) -> str:
    """`2.13.0+cpu` -> `torch213`: AOTInductor packages and caches are tied to torch's minor version."""
    major, minor = version.split("+")[0].split(".")[:2]
    return "torch%s%s" % (major, minor)


def cuda_tag(cuda: Optional[str]) -> str:
    """`13.0` -> `cu130`; None -> `cpu`."""
    if not cuda:
        return "cpu"
    major, minor = (cuda.split(".") + ["0"])[:2]
    return "cu%s%s" % (major, minor)


def check_device(value: str) -> str:
    """`value` if it names a device an artifact can be built for or served on (cpu, cuda, cuda:N), else a
    ValueError naming it."""
    v = str(value).strip()
    kind, _, index = v.partition(":")
    if kind not in ("cpu", "cuda") or (index and not (kind == "cuda" and index.isdigit())):
        raise ValueError("device %r is not one laya-aot serves; use cpu, cuda or cuda:N" % v[:40])
    return v


def current_gpu_arch(device_index: int = 0) -> Optional[str]:
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device_index)
    return "sm_%d%d" % (major, minor)


def current_machine(device: Optional[str] = None) -> Machine:
    """The facts of this process. `device` of type cpu hides the GPU (a CPU agent cannot use it)."""
    import torch

    use_cuda = device is None or str(device).startswith("cuda")
    arch = current_gpu_arch() if use_cuda else None
    gpu_name = None
    if arch:
        try:
            gpu_name = torch.cuda.get_device_name()
        except Exception:  # noqa: BLE001 - unknown: an artifact bound to a GPU name is refused here
            pass
    return Machine(
        torch=torch.__version__.split("+")[0],
        cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        cpu_isa=torch.backends.cpu.get_cpu_capability(),
        cuda=torch.version.cuda if arch else None,
        gpu_arch=arch,
        machine=platform.machine().lower(),
        os=sys.platform,
        python="%d.%d" % sys.version_info[:2],
        torch_build=torch.__version__,
        python_build=platform.python_version(),
        triton=triton_version() if arch else None,
        gpu_name=gpu_name,
    )


def triton_version() -> Optional[str]:
    """The installed triton's major.minor (what torch compares for a precompiled function), read from its
    package metadata: importing triton costs a start time it does not need. None when none is installed."""
    from importlib import metadata

    for dist in ("triton", "pytorch-triton"):
        try:
            return ".".join(metadata.version(dist).split(".")[:2])
        except metadata.PackageNotFoundError:
            continue
    return None


TRACED = ("laya", "transformers", "kernels")  # the packages whose Python code a precompiled function traces


@functools.lru_cache(maxsize=1)
def traced_packages() -> str:
    """The installed versions of `TRACED`, from their package metadata ("none" where absent): a precompiled
    function holds laya's and transformers' code as it was traced, and with `kernels` installed (transformers
    >= 5.25 requires it) that code wraps ModernBERT's functions in objects a process without it cannot load."""
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "none"

    return " ".join("%s==%s" % (dist, version(dist)) for dist in TRACED)


def build_machine(device: Optional[str] = None) -> Machine:
    """What a build records of its machine: `current_machine`'s facts and the traced packages' versions."""
    return replace(current_machine(device), traced_packages=traced_packages())


def native_variant(m: Machine, device: str) -> str:
    """The variant of compiled native code built on `m` for `device` (kinds with other needs spell their own).

    cpu:  torch213-cxx11-cpu-avx512-x86_64-linux
    cuda: torch211-cxx11-cu130-sm_90-x86_64-linux
    """
    abi = "cxx11" if m.cxx11_abi else "cxx98"
    plat = "%s-%s" % (m.machine, m.os)
    if device == "cpu":
        return "%s-%s-cpu-%s-%s" % (torch_tag(m.torch), abi, m.cpu_isa.lower(), plat)
    return "%s-%s-%s-%s-%s" % (torch_tag(m.torch), abi, cuda_tag(m.cuda), m.gpu_arch, plat)


def isa_satisfies(have: str, need: str) -> bool:
    """True when a CPU reporting `have` can execute code compiled for `need`."""
    if need in (None, "", "DEFAULT") or have == need:
        return True
    order = {name: i for i, name in enumerate(ISA_ORDER)}
    # only the x86 ladder is ordered; other ISAs must match exactly
    if need in ("AVX2", "AVX512") and have in ("AVX2", "AVX512"):
        return order[have] >= order[need]
    return False


def mismatch(needs: "Needs", m: Machine) -> Optional[str]:
    """Why a machine `m` cannot run an artifact that needs `needs` by the facts every kind shares (torch's minor
    version and ABI, the CPU or GPU, CUDA, the platform), or None when it can; what a kind alone needs is its own
    `Kind.misfit`, asked first (`kinds.usable.machine_misfit`)."""
    needs = {k: v for k, v in asdict(needs).items() if v is not None}
    why = []
    if needs.get("torch") and torch_tag(str(needs["torch"])) != torch_tag(m.torch):
        why.append(torch_fix("built for torch %s, this process has torch %s" % (needs["torch"], m.torch),
                             str(needs["torch"])))
    if "cxx11_abi" in needs and needs["cxx11_abi"] is not None and bool(needs["cxx11_abi"]) != m.cxx11_abi:
        why.append("built with cxx11_abi=%s, torch here has %s" % (needs["cxx11_abi"], m.cxx11_abi))
    if needs.get("machine") and needs["machine"] != m.machine:
        why.append("built for %s, this machine is %s" % (needs["machine"], m.machine))
    if needs.get("os") and needs["os"] != m.os:
        why.append("built for %s, this is %s" % (needs["os"], m.os))
    dev = needs.get("device")
    if dev == "cpu" and needs.get("cpu_isa") and not isa_satisfies(m.cpu_isa, str(needs["cpu_isa"])):
        why.append("needs CPU instructions %s, this CPU has %s" % (needs["cpu_isa"], m.cpu_isa))
    if dev == "cuda":
        if not m.gpu_arch:
            why.append("needs a CUDA GPU (%s), none is visible to this process" % needs.get("gpu_arch"))
        else:
            want = str(needs.get("gpu_arch") or "")
            if want and want.rstrip("a") != m.gpu_arch:
                why.append("compiled for %s, this GPU is %s" % (want, m.gpu_arch))
            if needs.get("cuda") and m.cuda and str(needs["cuda"]).split(".")[0] != str(m.cuda).split(".")[0]:
                why.append("built against CUDA %s, torch here uses CUDA %s" % (needs["cuda"], m.cuda))
    return "; ".join(why) or None


def torch_fix(why: str, torch: str) -> str:
    """`why` an artifact tied to torch `torch` is refused, with the fix: that torch here, or a build with this one."""
    return ("%s: install the torch it was built with (`pip install torch==%s`), or rebuild the bundle with this "
            "torch (`laya-aot build`)" % (why, torch.split("+")[0]))


SOFTWARE = ("torch", "cxx11_abi", "cuda")


def with_software_of(m: Machine, needs: "Needs") -> Machine:
    """`m` with the installed software an artifact needing `needs` was built with (torch and its C++ ABI and CUDA
    runtime); its hardware stays `m`'s. An artifact `mismatch` refuses on `m` but not on this is refused for what
    an install changes, not for the machine (what its kind alone needs says so itself: `Misfit.software`)."""
    got = {k: getattr(needs, k) for k in SOFTWARE if getattr(needs, k) is not None}
    if "torch" in got:
        got["torch"] = str(got["torch"]).split("+")[0]
    if m.cuda is None:
        got.pop("cuda", None)  # no GPU here: no CUDA runtime to match; a CUDA artifact is refused for the GPU
    return replace(m, **got)
