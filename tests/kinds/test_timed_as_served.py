"""The build times each artifact as an agent serves it by default: CUDA graphs where the loader replays them.

The loader ranks artifacts on the build's latency figures; timed without the graphs it serves with, an
AOTInductor artifact's small calls looked slower than it serves them, against TileLang's (laya's fast path always
graphs), and the ranking favoured TileLang on checkpoints where AOTInductor serves faster.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from laya_aot import kinds
from laya_aot.pipeline import stages
from laya_aot.runtime import trial


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "cpu"])
def test_the_build_loads_every_kind_with_the_graphs_the_loader_serves_it_with(device):
    # catches: the build timing an artifact without the CUDA graphs the loader replays it with (or with graphs
    # the loader never uses), so the manifest's mix is not what serving pays
    ref = SimpleNamespace(model=None)
    graphed = []
    for kind in kinds.REGISTRY:
        art = SimpleNamespace(kind=kind.name, device=device, dtype="bf16")
        env = stages._load_env(None, kind, art, ref, {}, {"bf16": object()})   # a GPU agent already made
        served = trial._graphs_wanted(True, art, torch.device(device), False, {})
        assert env.cuda_graphs == served, kind.name
        if served:
            graphed.append(kind.name)
    assert graphed == (["aoti"] if device.startswith("cuda") else [])
