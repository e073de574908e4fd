"""Padding and the backend's per-call routing, with a fake runner (no artifact needed)."""
from __future__ import annotations

import torch

from laya_aot.manifest import Artifact, Needs
from laya_aot.padding import Ranges, chunks, pad_batch
from laya_aot.runtime.backend import AOTBackend

R = Ranges(min_rows=1, max_rows=4, min_tokens=32, max_tokens=64, min_markers=2, max_markers=5)


def _batch(n=3, t=37, k=1):
    return (torch.randint(5, 50, (n, t)), torch.ones((n, t), dtype=torch.long), torch.ones((n, k), dtype=torch.long),
            torch.ones((n, k), dtype=torch.bool), torch.zeros(n, dtype=torch.long))


def test_tokens_pad_to_the_multiple_with_pad_id_and_no_attention():
    ids, att, mpos, mmask, qt = pad_batch(_batch(t=37, k=1), R, pad_id=9)
    assert ids.shape == (3, 48) and (ids[:, 37:] == 9).all() and (att[:, 37:] == 0).all()
    assert mpos.shape == (3, 2) and not mmask[:, 1].any()
    assert pad_batch(_batch(t=5), R, 0)[0].shape[1] == 32           # up to the exported minimum


def test_out_of_range_and_chunks():
    assert R.out_of_range(64, 5) is None
    assert R.out_of_range(65, 2) == "tokens>64" and R.out_of_range(16, 6) == "markers>5"
    assert [(s.start, s.stop) for s in chunks(9, R)] == [(0, 4), (4, 8), (8, 9)]


class _Model(torch.nn.Module):
    def forward(self, ids, att, mpos, mmask, qt, detach_encoder=False, **kw):
        return mpos.float() * 0 + 1.0, torch.zeros(ids.shape[0], 3)


class _Agent:
    def __init__(self):
        self.model = _Model()


class _Runner:
    device = torch.device("cpu")

    def __init__(self):
        self.shapes = []

    def __call__(self, ids, att, mpos, mmask, qt):
        self.shapes.append((tuple(ids.shape), tuple(mpos.shape)))
        return mpos.float() * 0 + 2.0, torch.ones(ids.shape[0], 3)


def _backend():
    runner = _Runner()
    entry = Artifact(name="x", kind="aoti", status="verified", device="cpu", needs=Needs(device="cpu"), ranges=R,
                     variant="v")
    return AOTBackend(_Agent(), runner, entry, pad_id=0), runner


def test_backend_pads_chunks_and_slices_back():
    be, runner = _backend()
    logits, act = be.forward(*_batch(n=9, t=37, k=1))
    assert logits.shape == (9, 1) and act.shape == (9, 3) and (logits == 2).all()
    assert runner.shapes == [((4, 48), (4, 2)), ((4, 48), (4, 2)), ((1, 48), (1, 2))]
    assert be.stats == {"artifact_calls": 1, "chunks": 3}


def test_backend_runs_eager_outside_the_export_and_counts_why():
    be, runner = _backend()
    logits, _ = be.forward(*_batch(n=2, t=80))
    assert (logits == 1).all() and not runner.shapes
    be.forward(*_batch(n=2, t=20, k=7))
    be.forward(*_batch(n=2, t=20), position_ids=torch.zeros(2, 20), option_ids=torch.zeros(2, 20))
    assert be.stats == {"eager_calls": 3, "eager_tokens": 1, "eager_markers": 1, "eager_parallel_layout": 1}
