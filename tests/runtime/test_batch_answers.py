"""A request's answer does not depend on its neighbours: the same request in a merged call of the dynamic batcher
(laya_aot/runtime/batcher.py) and alone, on 10,000 fuzzed requests in random batches, on the demo bundle.

Alone, a request is what laya's `system_one` sends the artifact: its own rows, padded to its own longest row and
marker count. In a batch it is a slice of a wider call, padded to the call's longest row, and the artifact runs
it beside other rows (in pieces of at most the export's rows, `padding.chunks`). Its decisions must be equal and
its probabilities within the artifact's verified bound (`VerifyResult.tolerance`). Bit-for-bit equality is
measured, not required: another padded length changes the length of every reduction over tokens (attention's
softmax and sums, which skip nothing but add masked zeros in another order and vector width), and another row
count changes the GEMM's blocking; both move the last bits of fp32 results.

The batched side is few calls (the 10,000 requests in random batches of up to 400 states, each `predict_batch`
of laya's agent, the call the batcher makes); the alone side runs each request's own rows through the backend,
as `system_one` hands them to it (checked equal to what `system_one` sends, on a sample). `python -m pytest -s`
prints the figures (docs/batching.md quotes them).
"""
from __future__ import annotations

import contextlib
import random
from typing import Any, Dict, List, Tuple

import pytest
import torch

from laya_aot.commands import DEMO_QUESTIONS
from tests.questions import assert_same_answers, question_suite, state_text

N_REQUESTS = 10_000
QUESTION_SETS = 24


def _fuzzed(n: int, seed: int) -> Tuple[List[Dict[str, Any]], List[Tuple[Any, int]]]:
    """`QUESTION_SETS` question sets (1-5 of laya-aot's 60-question suite, each kind and option count) and `n`
    requests (state, question set): text of 1-40 words (a row of 20-120 tokens with its question: short, so that
    10,000 requests alone stay seconds), and JSON objects and conversation lists, which laya serialises."""
    import numpy as np

    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    suite = question_suite()
    names = list(suite)
    sets = [{q: suite[q] for q in rng.sample(names, rng.randint(1, 5))} for _ in range(QUESTION_SETS - 1)]
    sets.append(dict(DEMO_QUESTIONS))
    requests = []
    for i in range(n):
        words = int(nrng.integers(1, 41))
        kind = i % 10
        if kind == 8:
            state: Any = {"subject": state_text(nrng, 3), "body": state_text(nrng, words)}
        elif kind == 9:
            state = [state_text(nrng, max(1, words // 3)) for _ in range(3)]
        else:
            state = state_text(nrng, words)
        requests.append((state, rng.randrange(len(sets))))
    return sets, requests


class Recorder:
    """Every batch the agent's backend is handed and what it answered (our AOTBackend's own `forward`)."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.forward = backend.forward
        self.calls: List[Tuple[Tuple[torch.Tensor, ...], Tuple[torch.Tensor, torch.Tensor]]] = []

    def __enter__(self) -> "Recorder":
        def forward(input_ids, attention_mask, marker_pos, marker_mask, qtype, *a, **k):
            out = self.forward(input_ids, attention_mask, marker_pos, marker_mask, qtype, *a, **k)
            self.calls.append(((input_ids, attention_mask, marker_pos, marker_mask, qtype), out))
            return out

        # both ways in: laya's `_infer` calls the module's forward, the batch handed on the host (`host_call`) the
        # backend's own
        self.backend.model.forward = self.backend.forward = forward
        return self

    def __exit__(self, *exc: Any) -> None:
        self.backend.model.forward = self.forward
        del self.backend.forward


def _own_rows(batch: Tuple[torch.Tensor, ...], rows: slice) -> Tuple[torch.Tensor, ...]:
    """A request's rows of a merged call as laya collates them alone: padded to its own longest row and to its own
    most markers (the columns past them in the merged call are padding)."""
    ids, att, mpos, mmask, qtype = (t[rows] for t in batch)
    tokens = int(att.sum(-1).max())
    markers = int(mmask.sum(-1).max())
    # contiguous, as laya's collation makes them (an AOTInductor package reads its inputs as contiguous)
    return tuple(t.contiguous() for t in (ids[:, :tokens], att[:, :tokens], mpos[:, :markers], mmask[:, :markers],
                                          qtype))


def _probs(logits: torch.Tensor, mmask: torch.Tensor) -> torch.Tensor:
    masked = logits.float().masked_fill(~mmask.bool(), float("-inf"))
    return torch.softmax(masked, -1).nan_to_num(0.0)


class Stepped:
    """The agent's runner as one with CUDA graphs is called (`padding.for_runner`): each call small enough for a
    graph padded to its stepped shape, every replay a plain call at that shape (a graph replays the kernels its
    capture recorded, on the same inputs: `kinds/graphs.py` checks each capture against the plain call)."""

    def __init__(self, backend: Any, max_tokens: int):
        from laya_aot.kinds.graphs import GraphedCalls

        self.runner = backend.runner
        plain = getattr(self.runner, "_run", self.runner)
        self.graphs = GraphedCalls(plain, max_tokens=max_tokens, graph_factory=_PlainGraph)

    def __enter__(self) -> "Stepped":
        self.before = getattr(self.runner, "graphs", None)
        self.runner.graphs = self.graphs
        return self

    def __exit__(self, *exc: Any) -> None:
        self.runner.graphs = self.before


class _PlainGraph:
    def __init__(self, fn: Any, inputs: Any, pool: Any):
        self.fn = fn

    def replay(self, inputs: Any, out_device: Any = None) -> List[torch.Tensor]:
        return [o.to(out_device) if out_device is not None else o for o in self.fn(*inputs)]

    def pool(self) -> None:
        return None


def measure(agent: Any, n: int = N_REQUESTS, seed: int = 0, max_batch: int = 400,
            stepped: int = 0) -> Dict[str, Any]:
    """The fuzzed requests in random merged calls against each alone: the figures the test asserts. `stepped`:
    the merged calls padded to their stepped shapes wherever rows x tokens <= `stepped` (a GPU's CUDA graphs)."""
    sets, requests = _fuzzed(n, seed)
    rng = random.Random(seed + 1)
    backend = agent.backend_object
    by_set: Dict[int, List[int]] = {}
    for i, (_, s) in enumerate(requests):
        by_set.setdefault(s, []).append(i)
    merged_calls, alone_calls = 0, 0
    worst_option = worst_action = 0.0
    bitwise = same_decisions = decisions = near_ties = 0
    for s, idx in by_set.items():
        rng.shuffle(idx)
        nq = len(sets[s])
        start = 0
        while start < len(idx):
            size = rng.randint(1, max_batch)
            part = idx[start:start + size]
            start += size
            with Recorder(backend) as rec, (Stepped(backend, stepped) if stepped else contextlib.nullcontext()):
                agent.predict_batch([requests[i][0] for i in part], sets[s])
            merged_calls += 1
            assert len(rec.calls) == 1, "one predict_batch call is one backend call"
            batch, (logits, act) = rec.calls[0]
            assert batch[0].shape[0] == len(part) * nq
            for j, _ in enumerate(part):
                rows = slice(j * nq, (j + 1) * nq)
                own = _own_rows(batch, rows)
                with torch.no_grad():
                    lo, ac = backend.forward(*own)
                alone_calls += 1
                k = own[3].shape[1]
                got_lo, got_ac = logits[rows][:, :k], act[rows]
                bitwise += int(torch.equal(got_lo, lo[:, :k]) and torch.equal(got_ac, ac))
                p_got, p_alone = _probs(got_lo, own[3]), _probs(lo[:, :k], own[3])
                worst_option = max(worst_option, float((p_got - p_alone).abs().max()))
                worst_action = max(worst_action, float((torch.softmax(got_ac.float(), -1)
                                                        - torch.softmax(ac.float(), -1)).abs().max()))
                top2 = p_alone.topk(min(2, k), -1).values
                gap = (top2[:, 0] - top2[:, 1]) if k > 1 else torch.ones(nq)
                decisions += nq
                same = p_got.argmax(-1) == p_alone.argmax(-1)
                same_decisions += int(same.sum())
                near_ties += int(((~same) & (gap <= backend.verify.tolerance)).sum())
    return {"requests": n, "merged_calls": merged_calls, "alone_calls": alone_calls,
            "stepped_calls": backend.stats.get("stepped_calls", 0),
            "bitwise_equal_requests": bitwise, "bitwise_fraction": round(bitwise / n, 4),
            "max_abs_option_prob": worst_option, "max_abs_action_prob": worst_action,
            "decisions": decisions, "same_decisions": same_decisions, "differ_within_bound": near_ties,
            "bound": backend.verify.tolerance, "artifact": backend.artifact.name}


@pytest.fixture(scope="module")
def agent(demo_ckpt, demo_bundle):
    import laya_aot

    return laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle))


def test_ten_thousand_fuzzed_requests_answer_in_batches_as_alone(agent):
    figures = measure(agent)
    print("\nbatched against alone:", figures)
    assert figures["merged_calls"] <= 200 and figures["alone_calls"] == N_REQUESTS
    assert figures["bound"] is not None and figures["bound"] > 0
    assert figures["max_abs_option_prob"] <= figures["bound"], figures
    assert figures["max_abs_action_prob"] <= figures["bound"], figures
    # a decision may differ only where the alone answer's top two options are within the bound of each other
    assert figures["same_decisions"] + figures["differ_within_bound"] == figures["decisions"], figures


def test_calls_padded_to_their_cuda_graph_shapes_answer_as_alone(agent):
    """A GPU replays a call from a CUDA graph at its stepped shape (`padding.Ranges.call_shape`: more rows, each a
    copy of the last, more masked tokens and markers): a request's answer in such a call equals its answer
    alone (its own rows, no stepping) within the artifact's bound, decisions equal but for near-ties."""
    backend = agent.backend_object
    backend.reset_stats()
    figures = measure(agent, n=2_000, seed=5, max_batch=40, stepped=8192)
    print("\nstepped calls against alone:", figures)
    assert figures["stepped_calls"] >= 20, figures          # the calls were stepped, not left at their own shapes
    assert figures["max_abs_option_prob"] <= figures["bound"], figures
    assert figures["max_abs_action_prob"] <= figures["bound"], figures
    assert figures["same_decisions"] + figures["differ_within_bound"] == figures["decisions"], figures


def test_the_alone_rows_are_what_system_one_sends(agent):
    """The alone side above is laya's own: what `system_one` hands the backend equals the request's rows cut out
    of a merged call (so the comparison is against the answer laya gives the request alone)."""
    sets, requests = _fuzzed(60, seed=7)
    backend = agent.backend_object
    for state, s in requests:
        with Recorder(backend) as merged:
            agent.predict_batch([requests[0][0], state, requests[1][0]], sets[s])
        with Recorder(backend) as alone:
            agent.system_one(state, sets[s])
        nq = len(sets[s])
        own = _own_rows(merged.calls[0][0], slice(nq, 2 * nq))
        sent = alone.calls[0][0]
        assert all(torch.equal(a, b) for a, b in zip(own, sent))


def test_the_batcher_answers_each_request_as_laya_answers_it_alone(agent):
    """End to end, through the Batcher's merged calls: each answer is `system_one`'s for the same request, its
    probabilities within laya's 4-decimal rounding of the bound."""
    from laya_aot.runtime.batcher import Batcher, Limits

    sets, requests = _fuzzed(400, seed=11)
    with Batcher(agent, Limits(max_rows=256)) as batcher:
        gate = batcher.submit_job(lambda: None)   # submitted together: they queue behind it
        futures = [batcher.submit(state, sets[s]) for state, s in requests]
        gate.result(10)
        answers = [f.result(120) for f in futures]
    snap = batcher.stats.snapshot()
    assert snap["calls"]["merged"] >= 1 and snap["batch_requests"]["sum"] == len(requests)
    for (state, s), got in zip(requests, answers):
        ref = agent.system_one(state, sets[s])
        assert_same_answers(got["answers"], ref["answers"], tol=1e-4 + agent.backend_object.verify.tolerance)
        assert got["usage"] == ref["usage"] and got["model"] == ref["model"]
