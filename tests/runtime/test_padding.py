"""Padding and the backend's per-call routing, with a fake runner (no artifact needed)."""
from __future__ import annotations

import pytest
import torch

from laya_aot.manifest import Artifact, Needs
from laya_aot.padding import Ranges, chunks, pad_batch, pad_call, step_up
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
    spans = lambda *a: [(s.start, s.stop) for s in chunks(*a)]  # noqa: E731
    assert spans(9, R) == [(0, 3), (3, 6), (6, 9)]  # max_rows 4: three even pieces, not 4 + 4 + 1
    assert spans(4, R) == [(0, 4)] and spans(1, R) == [(0, 1)] and spans(0, R) == []
    assert spans(4, R, 64, 128) == [(0, 2), (2, 4)]  # 128 tokens a piece: two rows of 64
    assert spans(3, R, 64, 10) == [(0, 1), (1, 2), (2, 3)]  # a budget under one row still runs one row a piece
    assert spans(9, R, 64, 0) == spans(9, R)  # no budget: max_rows alone


def test_a_wide_batch_runs_in_pieces_within_the_token_budget_with_the_same_answers():
    from laya_aot.padding import CHUNK_TOKENS

    backend, runner = _backend()
    ids = torch.full((7, 60), 5)
    batch = (ids, torch.ones_like(ids), torch.tensor([[1, 2]] * 7), torch.ones((7, 2), dtype=torch.bool),
             torch.zeros(7, dtype=torch.long))
    whole = backend.forward(*batch)
    runner.shapes.clear()
    backend.chunk_tokens = 128  # 64 padded tokens a row: two rows a piece
    pieces = backend.forward(*batch)
    assert [s[0] for s, _ in runner.shapes] == [2, 2, 2, 1]
    assert all(torch.equal(a, b) for a, b in zip(whole, pieces))
    assert CHUNK_TOKENS >= 64 * 256  # the default leaves a 64-row export of 256 tokens in one piece


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


def _backend(ranges: Ranges = R):
    runner = _Runner()
    entry = Artifact(name="x", kind="aoti", status="verified", device="cpu", needs=Needs(device="cpu"),
                     ranges=ranges, variant="v")
    return AOTBackend(_Agent(), runner, entry, pad_id=0), runner


def test_backend_pads_chunks_and_slices_back():
    be, runner = _backend()
    logits, act = be.forward(*_batch(n=9, t=37, k=1))
    assert logits.shape == (9, 1) and act.shape == (9, 3) and (logits == 2).all()
    assert runner.shapes == [((3, 48), (3, 2))] * 3  # 9 rows over max_rows 4: three even pieces
    assert be.stats == {"artifact_calls": 1, "chunks": 3}


def test_call_sizes_are_few_and_pad_by_at_most_a_quarter():
    sizes = sorted({step_up(n) for n in range(1, 65)})
    assert sizes == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64]
    assert all(n <= step_up(n) < 1.25 * n for n in range(9, 5000)) and step_up(0) == 1
    assert all(step_up(step_up(n)) == step_up(n) for n in range(1, 5000))   # a stepped size stays as it is


def test_a_call_shape_is_stepped_inside_the_artifacts_ranges():
    wide = Ranges(min_rows=1, max_rows=64, min_tokens=16, max_tokens=208, min_markers=2, max_markers=6)
    assert wide.call_shape(33, 37, 1) == (40, 48, 2)       # rows 33 -> 40; 3 token units; markers to the minimum
    assert wide.call_shape(9, 150, 5) == (10, 160, 5)      # 10 units of 16 stay 10 (160)
    assert wide.call_shape(61, 200, 6) == (64, 208, 6)     # 13 units step to 14 (224): over the export, its max
    assert wide.call_shape(64, 208, 7)[2] == 6             # never past the artifact's markers either
    assert R.call_shape(3, 5, 1) == (3, 32, 2)             # the exported minimum of tokens


def test_a_padded_call_repeats_its_last_row_and_masks_new_tokens_and_markers():
    batch = pad_batch(_batch(n=3, t=37, k=1), R, pad_id=9)
    ids, att, mpos, mmask, qt = pad_call(batch, (4, 64, 3), pad_id=9)
    assert ids.shape == (4, 64) and mpos.shape == (4, 3) and qt.shape == (4,)
    assert torch.equal(ids[:3, :48], batch[0]) and (ids[:3, 48:] == 9).all() and (att[:3, 37:] == 0).all()
    assert torch.equal(ids[3], ids[2]) and torch.equal(att[3], att[2]) and torch.equal(mpos[3], mpos[2])
    assert not mmask[:, 2:].any() and torch.equal(mmask[:, :2], torch.cat((batch[3], batch[3][2:])))


def test_the_backend_pads_a_graphed_call_to_its_stepped_shape_and_keeps_its_own_rows():
    """A runner with CUDA graphs gets each call at its stepped shape (`GraphedCalls.shape_for`), too large a call
    at its own; the outputs are the call's own rows, as without stepping (rows do not see one another)."""
    from laya_aot.kinds.graphs import GraphedCalls

    wide = Ranges(min_rows=1, max_rows=64, min_tokens=16, max_tokens=256, min_markers=2, max_markers=8)
    be, runner = _backend(wide)

    def rowwise(ids, att, mpos, mmask, qt):
        runner.shapes.append((tuple(ids.shape), tuple(mpos.shape)))
        return (ids[:, :mpos.shape[1]].float() + mpos.float(), att.sum(-1, keepdim=True).float().expand(-1, 3))

    be.runner = _RowwiseRunner(rowwise)
    batch = _batch(n=9, t=37, k=1)
    plain = be.forward(*batch)
    be.runner.graphs = GraphedCalls(rowwise, max_tokens=1024)
    stepped = be.forward(*batch)
    assert all(torch.equal(a, b) for a, b in zip(plain, stepped)) and stepped[0].shape == (9, 1)
    assert runner.shapes == [((9, 48), (9, 2)), ((10, 48), (10, 2))]
    be.forward(*_batch(n=30, t=37, k=1))     # 32 x 48 = 1536 padded cells: over 1024, its own shape
    assert runner.shapes[-1] == ((30, 48), (30, 2))
    assert be.stats["stepped_calls"] == 1 and be.stats["stepped_cells"] == 48


class _RowwiseRunner:
    device = torch.device("cpu")

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *xs):
        return self.fn(*xs)


def test_backend_runs_eager_outside_the_export_and_counts_why():
    be, runner = _backend()
    logits, _ = be.forward(*_batch(n=2, t=80))
    assert (logits == 1).all() and not runner.shapes
    be.forward(*_batch(n=2, t=20, k=7))
    be.forward(*_batch(n=2, t=20), position_ids=torch.zeros(2, 20), option_ids=torch.zeros(2, 20))
    assert be.stats == {"eager_calls": 3, "eager_tokens": 1, "eager_markers": 1, "eager_parallel_layout": 1}


def test_near_tie_rows_are_rows_with_two_options_closer_than_the_margin():
    from laya_aot.padding import near_tie_rows

    logits = torch.tensor([[2.0, 2.01, -1e4],     # a near-tie
                           [5.0, 0.0, -1e4],      # decisive
                           [3.0, -1e4, -1e4],     # one option: nothing to decide
                           [-1e4, -1e4, -1e4],    # laya's padding row: no options at all
                           [1.0, 0.0, 1.0]])      # an exact tie between the first and third option
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    assert near_tie_rows(logits, mask, 0.05).tolist() == [0, 4]
    assert near_tie_rows(logits, mask, 0.0).tolist() == [4]
    assert near_tie_rows(logits[:, :1], mask[:, :1], 1.0).tolist() == []


def test_tie_margin_is_twice_the_artifact_and_eager_bounds():
    from laya_aot.numerics.tolerance import Agreement, tie_margin

    art = Agreement(0.02, 0.5, 1.0)
    assert tie_margin(art) == 0.04                                      # fp32: eager is the reference
    assert abs(tie_margin(art, Agreement(0.01, 0.3, 0.99)) - 0.06) < 1e-12   # the action head does not count


class _TieModel(torch.nn.Module):
    """laya's eager forward in this test: row i prefers option 1 by 0.004 in probability."""

    def forward(self, ids, att, mpos, mmask, qt, detach_encoder=False, **kw):
        self.rows = getattr(self, "rows", []) + [ids[:, 0].tolist()]
        lo = torch.zeros(mpos.shape)
        lo[:, 1] = 0.016
        return lo, torch.full((ids.shape[0], 3), 7.0)


class _FlippedRunner(_Runner):
    """The artifact: rounds row 0 the other way (option 0 by 0.004) and row 1 decisively to option 0."""

    def __call__(self, ids, att, mpos, mmask, qt):
        lo = torch.full(mpos.shape, -1e4)
        lo[:, 0], lo[:, 1] = 0.016, 0.0
        lo[1:, 0] = 4.0
        return lo, torch.ones(ids.shape[0], 3)


def _tie_backend(near_ties="rows"):
    from laya_aot.manifest import VerifyResult
    from laya_aot.numerics.tolerance import Agreement

    agent = _Agent()
    agent.model = _TieModel()
    verify = VerifyResult(passed=True, tolerance=0.05, max_abs_option_prob=0.02, max_abs_action_prob=0.04,
                          argmax_agreement=1.0, eager_in_dtype=Agreement(0.01, 0.01, 1.0))
    entry = Artifact(name="x", kind="aoti", status="verified", device="cpu", needs=Needs(device="cpu"), ranges=R,
                     variant="v", verify=verify)
    return AOTBackend(agent, _FlippedRunner(), entry, pad_id=0, near_ties=near_ties), agent.model


def test_near_ties_are_laya_eagers_own_decisions_and_only_those_rows_rerun():
    be, model = _tie_backend()
    assert abs(be.tie_margin - 0.06) < 1e-12
    ids, att, mpos, mmask, qt = _batch(n=3, t=37, k=2)
    ids[:, 0] = torch.tensor([10, 11, 12])
    logits, act = be.forward(ids, att, mpos, mmask, qt)
    assert logits.argmax(-1).tolist() == [1, 0, 0]           # row 0: eager's choice; rows 1-2: the artifact's
    assert (act[0] == 7).all() and (act[1:] == 1).all()
    assert model.rows == [[10]]                              # eager ran the near-tie row only
    assert be.stats == {"artifact_calls": 1, "chunks": 1, "near_tie_calls": 1, "near_tie_rows": 1}
    # what the smoke check compares is the artifact's own output
    assert be.artifact_forward(ids, att, mpos, mmask, qt)[0].argmax(-1).tolist() == [0, 0, 0]


def test_near_ties_off_leaves_every_row_to_the_artifact():
    be, model = _tie_backend(near_ties=False)
    assert be.tie_margin is None
    logits, _ = be.forward(*_batch(n=3, t=37, k=2))
    assert logits.argmax(-1).tolist() == [0, 0, 0] and not hasattr(model, "rows")


def test_near_ties_call_mode_returns_laya_eagers_outputs_for_the_whole_batch():
    be, model = _tie_backend(near_ties="call")
    ids, att, mpos, mmask, qt = _batch(n=3, t=37, k=2)
    ids[:, 0] = torch.tensor([10, 11, 12])
    logits, act = be.forward(ids, att, mpos, mmask, qt)
    ref_logits, ref_act = _TieModel()(ids, att, mpos, mmask, qt)
    assert torch.equal(logits, ref_logits) and torch.equal(act, ref_act)   # every row, not only the near-tie
    assert model.rows == [[10, 11, 12]]                                    # one eager call on the same batch
    assert be.stats == {"artifact_calls": 1, "chunks": 1, "near_tie_calls": 1, "near_tie_rows": 1,
                        "near_tie_whole_calls": 1}
    # a call without a near-tie stays the artifact's
    ids2, att2, mpos2, mmask2, qt2 = _batch(n=2, t=37, k=2)
    be.near_ties = "call"
    be.runner = _DecisiveRunner()
    logits2, _ = be.forward(ids2, att2, mpos2, mmask2, qt2)
    assert logits2.argmax(-1).tolist() == [0, 0] and model.rows == [[10, 11, 12]]


class _DecisiveRunner(_Runner):
    def __call__(self, ids, att, mpos, mmask, qt):
        lo = torch.full(mpos.shape, -1e4)
        lo[:, 0], lo[:, 1] = 4.0, 0.0
        return lo, torch.ones(ids.shape[0], 3)


def test_near_tie_modes_are_checked_where_they_are_given():
    from laya_aot.runtime.backend import near_tie_mode
    from laya_aot.runtime.loader import load

    assert [near_tie_mode(v) for v in (True, False, "rows", "call", "off")] == ["call", "off", "rows", "call", "off"]
    with pytest.raises(ValueError, match="near_ties='exact' is not a near-tie mode; use 'call', 'rows', 'off'"):
        near_tie_mode("exact")
    with pytest.raises(ValueError, match="near_ties=1 is not a near-tie mode"):
        load("/nonexistent", bundle=None, near_ties=1)   # the caller's mistake: raised before anything loads
    be, _ = _tie_backend()
    with pytest.raises(ValueError, match="not a near-tie mode"):
        be.near_ties = "sometimes"
    assert be.near_ties == "rows"
    assert AOTBackend(be.agent, _FlippedRunner(), be.artifact, pad_id=0).near_ties == "off"   # the default


def test_verification_cases_stay_inside_the_checkpoints_context():
    """A manifest's max_tokens must not decide how long the verify cases are: laya never sends a row longer
    than the checkpoint's context, and a forward of 50256 tokens had a worker killed for memory."""
    from laya_aot.verification import cases

    wide = Ranges(1, 8, 16, 50256, 2, 64)
    assert max(c.batch[0].shape[1] for c in cases(3, wide, 100, 0)) == 50256     # what the bound prevents
    bounded = cases(3, wide, 100, 0, context=256)
    assert max(c.batch[0].shape[1] for c in bounded) == 256
    assert [c.name for c in bounded] == [c.name for c in cases(3, R, 100, 0)]   # the same cases, only shorter


@pytest.mark.parametrize("context", [32, 40, 64, 100, 200, 256, 510])
def test_verification_cases_fit_a_context_that_is_not_a_multiple_of_the_token_step(context):
    """A checkpoint of any context gets cases no longer than it: with a context of 64, `r(20, 64) | 1` once drew
    65 tokens and odd_tokens' fixed 45 and max_rows' 24-40 overran a context of 32, and every artifact of such a
    checkpoint failed verification (benchmarks/config_fuzz.py)."""
    from laya_aot.padding import context_tokens
    from laya_aot.verification import cases, decision_cases

    exported = Ranges(1, 8, 32, context_tokens(context), 2, 8)
    for seed in range(40):
        made = cases(seed, exported, 100, 0, context=context) + decision_cases(seed, exported, 100, 0, context, 48)
        assert max(c.batch[0].shape[1] for c in made) <= context, seed
        assert all(int(c.batch[1].sum(1).max()) <= context for c in made), seed


def test_the_export_reaches_the_context_rounded_up_to_the_token_step():
    """Tokens are exported as 16 x Dim: a context of 200 exports 208 (200 cannot be exported, and 192 would leave
    rows of 193-200 tokens to laya's eager forward)."""
    from laya_aot.padding import TOKEN_MULTIPLE, context_tokens

    assert [context_tokens(n) for n in (32, 33, 48, 200, 208, 512, 8190)] == [32, 48, 48, 208, 208, 512, 8192]
    assert all(context_tokens(n) % TOKEN_MULTIPLE == 0 and 0 <= context_tokens(n) - n < TOKEN_MULTIPLE
               for n in range(1, 3000))


def test_a_one_row_call_comes_back_at_the_request_s_width_and_ids_are_checked_both_ways():
    """The one-piece path: outputs at the request's own markers (padded ones dropped, none dropped where there
    were none), ids checked against the embedding at both ends before the runner sees them."""
    from laya_aot.runtime.backend import TokenIdError

    for k, width in ((1, 1), (2, 2), (3, 3)):
        be, runner = _backend()
        logits, act = be.forward(*_batch(n=1, t=20, k=k))
        assert logits.shape == (1, width) and act.shape == (1, 3) and (logits == 2).all()
        assert runner.shapes == [((1, 32), (1, max(2, k)))]
    be, runner = _backend()
    be.token_ids.rows = 50
    for bad in (50, -1):
        ids = torch.full((1, 20), 7)
        ids[0, 11] = bad
        with pytest.raises(TokenIdError, match="token id %d is past" % bad):
            be.forward(ids, *_batch(n=1, t=20, k=2)[1:])
    assert runner.shapes == []
    be.forward(torch.full((1, 20), 49), *_batch(n=1, t=20, k=2)[1:])
    assert runner.shapes == [((1, 32), (1, 2))]
