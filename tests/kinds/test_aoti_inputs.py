"""An AOTInductor package reads each input as laid out row after row: a strided view (a transpose, a column slice)
must reach it as its contiguous copy, or its answers are wrong without an error (`AOTIRunner._plain_run`)."""
from __future__ import annotations

import pytest
import torch

from laya_aot import kinds
from laya_aot.bundle_format import artifact_path, read_bundle
from laya_aot.padding import batch_of_shape


@pytest.mark.slow
def test_an_aoti_package_answers_a_strided_input_as_its_contiguous_copy(demo_bundle):
    art = read_bundle(demo_bundle, kinds.BY_NAME).artifact("aoti-cpu-frozen")
    runner = kinds.load(artifact_path(demo_bundle, art), art, kinds.LoadEnv(device="cpu"))
    ids, att, mpos, mmask, qtype = batch_of_shape(4, 128, 4)
    ids = torch.randint(5, 60, ids.shape, generator=torch.Generator().manual_seed(0))
    strided = ids.t().contiguous().t()   # the same values, laid out column after column
    assert not strided.is_contiguous() and torch.equal(strided, ids)
    with torch.no_grad():
        want = runner(ids, att, mpos, mmask, qtype)
        got = runner(strided, att, mpos, mmask, qtype)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
