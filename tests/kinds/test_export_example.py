"""The example batch an export is traced at (`export.example_rows`/`example_tokens`): AOTInductor tunes its
kernels' launch settings at its sizes, so a GPU export takes a large one; the CPU keeps the one it always had."""
from __future__ import annotations

import pytest
import torch

from laya_aot.config import compose
from laya_aot.kinds.exported_program import CPU_EXAMPLE, GPU_EXAMPLE, example_inputs, example_size


def test_each_device_has_its_default_within_the_declared_ranges():
    assert example_size("cuda", 64, 1024) == GPU_EXAMPLE == (8, 1024)
    assert example_size("cuda:1", 64, 1024) == (8, 1024)
    assert example_size("cuda", 4, 512) == (4, 512)          # capped by max_rows and max_tokens
    assert example_size("cpu", 64, 1024) == CPU_EXAMPLE == (3, 48)
    assert example_size("cpu", 2, 32) == (2, 32)


def test_asked_sizes_are_taken_and_bad_ones_name_the_setting():
    assert example_size("cuda", 64, 1024, 2, 256) == (2, 256)
    assert example_size("cpu", 64, 1024, 16, 512) == (16, 512)
    for rows, tokens in ((1, 256), (4, 100), (4, 16)):
        with pytest.raises(ValueError, match="export.example_rows"):
            example_size("cuda", 64, 1024, rows, tokens)


def test_the_cpu_example_is_the_batch_cpu_bundles_were_always_traced_at():
    ids, att, mpos, mmask, qtype = example_inputs(256, pad_id=1)
    g = torch.Generator().manual_seed(0)
    want = torch.randint(5, 200, (3, 48), generator=g)
    want[1, 43:] = 1
    assert torch.equal(ids, want)
    assert att.sum(1).tolist() == [48, 43, 48]
    assert mpos.tolist() == [[2, 5, 9]] * 3 and mmask.all() and qtype.tolist() == [0, 1, 2]


def test_a_large_example_keeps_every_input_consistent():
    ids, att, mpos, mmask, qtype = example_inputs(1024, pad_id=0, max_rows=64, rows=8, tokens=1024)
    assert ids.shape == att.shape == (8, 1024) and mpos.shape == mmask.shape == (8, 3)
    assert qtype.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert (ids[1, -5:] == 0).all() and att[1, -5:].sum() == 0 and att[0].all()


def test_the_settings_are_build_config_keys():
    cfg = compose(["export.example_rows=4", "export.example_tokens=512"])
    assert cfg.export.example_rows == 4 and cfg.export.example_tokens == 512
    assert compose().export.example_rows is None and compose().export.example_tokens is None
