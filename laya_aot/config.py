"""Structured (typed) Hydra configs for `laya-aot build`.

The dataclasses are the schema: Hydra rejects an unknown key or a value of the wrong type with an
error that names the key, before any work starts. The YAML files under `laya_aot/configs/` only
pick values; the shape lives here. Kinds read it typed (`kinds.BuildContext.cfg: BuildConfig`).

A kind's own settings belong to the kind: each is a dataclass in the kind's torch-free settings module
(`kinds/<stage>_settings.py`), composed here under the section its `Kind.config_section` names (`export`,
`aoti`). The command line checks overrides against this schema before torch is imported, so nothing this
module reaches imports torch: the settings modules import nothing of the package, and `laya_aot.kinds`
loads its registry (which imports every kind module, and torch) only on first use.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from .kinds.aoti_settings import AotiConfig
from .kinds.exported_program_settings import ExportConfig
from .numerics.tolerance import Tolerance


@dataclass
class CheckpointConfig:
    """Which Laya checkpoint to build from.

    `path` (a local checkpoint directory) wins; otherwise `hub_id`/`subfolder` name a shipped
    checkpoint that must already be in the local Hugging Face cache (nothing is downloaded);
    otherwise `demo_shape` makes the built-in demo checkpoint under `demo_dir`.
    `name` and `max_len` are read from the checkpoint when left null; the dtype artifacts are built in
    follows laya's policy for the checkpoint (`target.dtypes` to choose).
    """

    name: Optional[str] = None
    path: Optional[str] = None
    hub_id: Optional[str] = None
    subfolder: Optional[str] = None
    max_len: Optional[int] = None
    demo_shape: Optional[str] = None
    demo_seed: int = 0
    demo_dir: str = "artifacts/checkpoints"


@dataclass
class TargetConfig:
    """The machine the bundle is for: `cpu`, or a CUDA architecture such as `sm_90`."""

    name: str = "cpu"
    device: str = "cpu"
    # the GPU architecture the CUDA artifacts are compiled for (null on CPU)
    arch: Optional[str] = None
    # TileLang architectures to cross-compile kernels for (no GPU needed)
    tilelang_archs: List[str] = field(default_factory=list)
    # dtypes the encoder and decision head compute in, one set of artifacts each; empty = the dtype laya
    # serves this checkpoint in on this target (laya_aot.numerics.precision: CPU fp32; CUDA the checkpoint's
    # amp_dtype, fp16 when absent, fp16 below sm_80)
    dtypes: List[str] = field(default_factory=list)


@dataclass
class StagesConfig:
    """One switch per optional kind, named like its stage and module (`Kind.stage`). `exported_program` and
    `verify` cannot be turned off: nothing unverified ships."""

    aoti: bool = True
    onnx: bool = True
    tilelang: bool = True
    inductor_cache: bool = True


@dataclass
class VerifyConfig:
    seed: int = 1234
    # the rule every artifact is verified by (laya_aot.numerics.tolerance); stored in the manifest
    tolerance: Tolerance = field(default_factory=Tolerance)
    # timed rounds for the latency the runtime ranks by; each round calls every verified serving artifact once on
    # every reference shape, one after another (pipeline/stages._time_together)
    latency_repeats: int = 9


@dataclass
class BuildConfig:
    checkpoint: CheckpointConfig = MISSING
    target: TargetConfig = MISSING
    # the kinds' own sections (Kind.config_section), typed in each kind's settings module
    export: ExportConfig = field(default_factory=ExportConfig)
    aoti: AotiConfig = field(default_factory=AotiConfig)
    stages: StagesConfig = field(default_factory=StagesConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    # null = artifacts/<checkpoint name>
    output_dir: Optional[str] = None
    # replace output_dir even when laya-aot did not write what is there (staging.may_replace); a previous
    # bundle, or an empty directory, is replaced without it
    overwrite: bool = False
    # parallel compile jobs (null = all cores)
    jobs: Optional[int] = None


def register() -> None:
    """Register the schemas so YAML files can extend them (`defaults: [base_build, ...]`)."""
    cs = ConfigStore.instance()
    cs.store(name="base_build", node=BuildConfig)
    cs.store(group="checkpoint", name="base_checkpoint", node=CheckpointConfig)
    cs.store(group="target", name="base_target", node=TargetConfig)


def compose(overrides: Optional[List[str]] = None, config_dir: Optional[str] = None):
    """The resolved build config for `overrides`, as `laya-aot build` would see it (for Python callers).

    `config_dir` plays the part of `--config-dir`: a directory of the user's own config groups,
    searched before the packaged ones.
    """
    from hydra import compose as _compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    register()
    GlobalHydra.instance().clear()
    extra = ["hydra.searchpath=[file://%s]" % config_dir] if config_dir else []
    with initialize_config_module(config_module="laya_aot.configs", version_base="1.3"):
        return _compose(config_name="build", overrides=list(overrides or []) + extra)
