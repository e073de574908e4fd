"""Typed questions and states for comparing a bundle's answers with laya eager's, shared by the tests."""
from __future__ import annotations

from laya_aot.demo import question_suite, state_text  # noqa: F401 - re-exported for the tests


def _answer_key(a):
    if a["type"] == "choice":
        return a["choice"]
    if a["type"] == "score":
        p = a["probabilities"]
        return max(p, key=p.get)
    return a["noul"] > 0.5


def assert_same_answers(got, ref, tol=1e-4 + 1e-12):
    """laya rounds probabilities to 4 decimals: a raw difference of 1e-7 can still show as 1e-4."""
    assert got.keys() == ref.keys()
    for qid in ref:
        g, r = got[qid], ref[qid]
        assert _answer_key(g) == _answer_key(r), qid
        for k, v in (r.get("probabilities") or {}).items():
            assert abs(g["probabilities"][k] - v) <= tol, (qid, k)
        if r["type"] == "noul":
            assert abs(g["noul"] - r["noul"]) <= tol, qid
        assert abs(g["action"]["act_probability"] - r["action"]["act_probability"]) <= tol, qid
