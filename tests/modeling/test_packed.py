"""`modeling.packed`: a call's rows packed back to back answer as the same rows padded.

(1) `PackedModel` on `pack`'s inputs against `ExplicitDtypeModel` on the padded batch and laya's own forward, on
fuzzed batches of rows as laya collates them (right-padded, markers within each row), for two checkpoints (head
dims 16 and 32, windows 32 and 16), both heads, rows shorter and longer than a window, a row of one token; it can
fail: a segment that leaks into its neighbour answers differently. (2) `pack`'s layout and its refusals. (3) The
program exports with every size dynamic. (4) Where triton is installed, the kernel's segment form in Triton's
interpreter against `attention.reference`, with segments across key blocks and windows.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from laya_aot.modeling import attention
from laya_aot.modeling.model import ExplicitDtypeModel
from laya_aot.modeling.packed import INPUT_NAMES, PackedModel, pack
from tests.modeling.test_attention import HAVE_TRITON, SAME, _diff, _model


def _rows(lengths, width: int, markers: int, seed: int):
    """A batch as laya collates it: each row's tokens first, its markers among them, some markers masked."""
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    ids = torch.randint(5, 900, (n, width), generator=g)
    att = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids[att == 0] = 0
    mpos = torch.stack([torch.randint(0, length, (markers,), generator=g) for length in lengths])
    mmask = torch.ones(n, markers, dtype=torch.bool)
    mmask[0, -1] = False
    return ids, att, mpos, mmask, torch.arange(n) % 3


def _models(ckpt, head: str):
    model = _model(ckpt)
    kw = dict(head=head, rope_table=512)
    return model, ExplicitDtypeModel(model, torch.float32, torch.float32, "cpu", **kw), \
        PackedModel(model, torch.float32, torch.float32, "cpu", **kw)


@pytest.mark.parametrize("which", ["demo_ckpt", "alt_ckpt"])
@pytest.mark.parametrize("head", ["answer_rows", "full"])
def test_packed_rows_answer_as_padded_rows(which, head, request):
    laya_model, padded, packed = _models(request.getfixturevalue(which), head)
    w = attention.band_halfwidth(laya_model.encoder.config)
    cases = [[1], [5, 3 * w + 7, 17, 1], [4 * w + 9, 2 * w, w + 1], [40] * 6]
    for i, lengths in enumerate(cases):
        batch = _rows(lengths, -(-max(lengths) // 16) * 16, 4, seed=i)
        with torch.no_grad():
            want, alone, got = laya_model(*batch), padded(*batch), packed(*pack(batch, pad_id=0))
        assert [t.shape for t in got] == [t.shape for t in want]
        assert _diff(alone, got) < SAME, (which, head, lengths, _diff(alone, got))
        assert _diff(want, got) < SAME, (which, head, lengths, _diff(want, got))


def test_a_segment_that_sees_its_neighbour_is_caught(demo_ckpt):
    """The comparison above can fail: two rows packed as one segment answer differently."""
    _, padded, packed = _models(demo_ckpt, "answer_rows")
    batch = _rows([30, 50, 20], 64, 4, seed=3)
    inputs = list(pack(batch, pad_id=0))
    inputs[1] = torch.where(inputs[1] == 2, 1, inputs[1])  # rows 1 and 2 one segment, bounds left as they were
    with torch.no_grad():
        assert _diff(padded(*batch), packed(*inputs)) > 1e-3


def test_pack_lays_rows_back_to_back_and_refuses_what_it_cannot_pack():
    batch = _rows([3, 5, 1], 16, 2, seed=0)
    ids, seg, pos, lo, hi, index, att, mpos, mmask, qtype = pack(batch, pad_id=7, multiple=16)
    assert len(INPUT_NAMES) == 10 and ids.shape == (1, 16)
    assert seg[0].tolist() == [1] * 3 + [2] * 5 + [3] + [0] * 7
    assert pos[0, :9].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0] and ids[0, 9:].tolist() == [7] * 7
    assert lo[0, :9].tolist() == [0] * 3 + [3] * 5 + [8] and hi[0, :9].tolist() == [3] * 3 + [8] * 5 + [9]
    assert lo[0, 9:].tolist() == [16] * 7 and hi[0, 9:].tolist() == [0] * 7
    real = batch[1].bool()
    assert torch.equal(ids[0][index][real], batch[0][real]) and bool((index[~real] == 0).all())
    assert all(a is b for a, b in zip((att, mpos, mmask, qtype), batch[1:]))
    assert pack(_rows([40, 30], 48, 2, 1), 0, multiple=32)[0].shape == (1, 96)
    left = (batch[0], batch[1].flip(1)) + batch[2:]
    with pytest.raises(ValueError, match="padded on the right"):
        pack(left, 0)
    outside = batch[:2] + (torch.tensor([[0, 1], [1, 2], [0, 1]]),) + batch[3:]  # row 2 has one token
    with pytest.raises(ValueError, match="past its row's tokens"):
        pack(outside, 0)


@pytest.mark.slow
def test_the_packed_program_exports_with_every_size_dynamic(demo_ckpt):
    from torch.export import Dim

    _, padded, packed = _models(demo_ckpt, "answer_rows")
    t, s = 16 * Dim("t16", min=1, max=512), Dim("s", min=1, max=64)
    length, k = 16 * Dim("l16", min=2, max=32), Dim("k", min=2, max=64)
    dims = ({1: t},) * 5 + ({0: s, 1: length},) * 2 + ({0: s, 1: k},) * 2 + ({0: s},)
    with torch.no_grad():
        program = torch.export.export(packed, pack(_rows([20, 9, 32], 32, 3, 0), 0), dynamic_shapes=dims,
                                      strict=False)
        other = _rows([70, 3, 41, 16, 80], 80, 5, 1)
        assert _diff(padded(*other), program.module()(*pack(other, 0))) < SAME


SEGMENT_CASES = [  # rows x L of segments (lengths), heads, head dim, window (-1: global), dtype
    ([[5, 70, 3, 40], [150]], 2, 64, 8, "float16"),
    ([[200, 1, 33]], 2, 32, -1, "float16"),
    ([[17, 17, 17, 100, 64]], 1, 48, 16, "float32"),
    ([[300, 20]], 2, 64, 64, "float16"),
]

INTERPRET = """
import json, sys, torch
from laya_aot.modeling import attention, window_attention
out = []
for rows, heads, dim, window, dtype in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype)
    length = max(sum(r) for r in rows) + 29                     # padding after the last segment of every row
    seg = torch.zeros(len(rows), length, dtype=torch.int32)
    lo = torch.full((len(rows), length), length, dtype=torch.int32)
    hi = torch.zeros(len(rows), length, dtype=torch.int32)
    for b, lengths in enumerate(rows):
        at = 0
        for i, n in enumerate(lengths):
            seg[b, at:at + n], lo[b, at:at + n], hi[b, at:at + n] = i + 1, at, at + n
            at += n
    g = torch.Generator().manual_seed(length + dim)
    q, k, v = (torch.randn(len(rows), heads, length, dim, generator=g).to(dtype) for _ in range(3))
    w = None if window < 0 else window
    want = attention.reference(q, k, v, seg, w, dim ** -0.5, segments=True).float()
    got = window_attention.segment_attention(q, k, v, seg, lo, hi, window, dim ** -0.5)
    one = torch.where(seg > 0, 1, 0).to(torch.int32)            # every row one segment: neighbours seen
    leaky = window_attention.segment_attention(q, k, v, one, lo, hi, window, dim ** -0.5)
    out.append([list(got.shape), float((got.float() - want).abs().max()), float((leaky.float() - want).abs().max())])
print(json.dumps(out))
"""


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (the CUDA build's kernel): nothing to interpret")
def test_segment_kernel_in_triton_interpreter_equals_reference():
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", INTERPRET, json.dumps(SEGMENT_CASES)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    for case, (shape, diff, leaky) in zip(SEGMENT_CASES, json.loads(p.stdout)):
        rows, heads, dim, window, dtype = case
        assert shape == [len(rows), max(sum(r) for r in rows) + 29, heads, dim]
        tol = 2e-3 if dtype == "float16" else 1e-5
        assert diff < tol, (case, diff)
        assert leaky > 10 * tol, (case, leaky)  # it can fail: segments that see each other are caught


def test_a_cpu_target_is_refused_packed_rows(demo_ckpt, tmp_path):
    from laya_aot.config import compose
    from laya_aot.pipeline import build

    cfg = compose(["checkpoint.path=%s" % demo_ckpt, "output_dir=%s" % (tmp_path / "b"), "export.rows=packed",
                   "stages.onnx=false", "stages.aoti=false", "stages.inductor_cache=false"])
    with pytest.raises(Exception, match="export.rows=packed is for GPU targets"):
        build(cfg)


@pytest.mark.slow
def test_a_packed_bundle_verifies_and_answers_as_the_padded_one(demo_ckpt, demo_bundle, tmp_path, monkeypatch):
    """The whole path on this CPU (refused to users there, allowed here to test it without a GPU): the export of
    packed rows, its AOTInductor package, which takes the collated batch and packs it on the host, the build's
    verification of it, ONNX exported padded beside it, and a load that answers every call as the padded bundle."""
    import numpy as np

    import laya_aot
    from laya_aot.bundle_format import read_manifest
    from laya_aot.modeling import packed as packed_mod
    from tests.conftest import build_bundle
    from tests.questions import assert_same_answers, question_suite, state_text

    monkeypatch.setattr(packed_mod, "DEVICES", ("cuda", "cpu"))
    out = tmp_path / "packed"
    build_bundle(demo_ckpt, out, "export.rows=packed", "stages.inductor_cache=false", "stages.tilelang=false")
    arts = {a["name"]: a for a in read_manifest(out)["artifacts"]}
    assert arts["aoti-cpu"]["details"]["rows"] == "packed" and arts["aoti-cpu"]["status"] == "verified"
    assert arts["onnx-fp32"]["status"] == "verified"   # ONNX Runtime takes padded rows: exported padded
    packed = laya_aot.load(str(demo_ckpt), bundle=str(out), device="cpu", strict=True, prefer="aoti")
    padded = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", strict=True, prefer="aoti")
    assert packed.backend_object.runner.packed and not padded.backend_object.runner.packed
    suite = list(question_suite().items())
    rng = np.random.default_rng(7)
    for n, words in ((1, 5), (3, 40), (12, 15)):   # rows of many lengths in one call: short states, long heads
        states = [state_text(rng, int(rng.integers(1, words + 1))) for _ in range(n)]
        questions = dict(suite[n % 7::7][:4])
        got, ref = packed.predict_batch(states, questions), padded.predict_batch(states, questions)
        for g, r in zip(got, ref):
            assert_same_answers(g["answers"], r["answers"])


def test_a_packed_call_is_stepped_with_one_token_rows_and_a_stepped_packed_row():
    """Where a CUDA graph replays a packed call, its rows are stepped with rows of one pad token (a repeated row
    would be computed again) and its packed row's length is stepped (`padding.step_up`), so that calls recur."""
    from laya_aot.kinds.aoti import AOTIRunner
    from laya_aot.padding import pad_call

    batch = _rows([30, 21, 9], 32, 3, seed=4)
    stepped = pad_call(batch, (5, 48, 4), pad_id=1, one_token_rows=True)
    assert [t.shape[0] for t in stepped] == [5] * 5 and stepped[0].shape[1] == 48 and stepped[2].shape[1] == 4
    assert stepped[1][3:].sum(1).tolist() == [1, 1] and not stepped[3][3:].any() and bool((stepped[0][3:] == 1).all())
    runner = AOTIRunner.__new__(AOTIRunner)
    runner.packed = True
    graphs = type("G", (), {"max_tokens": 2048})()
    ids, seg = runner._inputs(stepped, graphs)[:2]
    assert int((seg > 0).sum()) == 62 and ids.shape == (1, 64)  # 62 tokens: 4 units of 16 step up to 4
    assert runner._inputs(_rows([300, 290], 304, 2, 0), graphs)[0].shape == (1, 640)  # 37 units -> 40
    assert runner._inputs(_rows([300, 290], 304, 2, 0), None)[0].shape == (1, 592)   # no graph: a multiple of 16
