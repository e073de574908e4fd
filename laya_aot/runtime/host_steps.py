"""laya's answer decoding with the numbers of a whole batch computed at once: the same answers, bit for bit; and
laya's collation of a batch in a few numpy operations (`collate`: the same arrays).

`Agent._decode_answers` turns one state's logit rows into answers, one row at a time: a dozen numpy calls on
arrays of two to seven floats per row, and per state the same per-question work (temperature lookup, option
keys, a score's legend). `Decoder` computes each question's rows for every state of the batch in one pass of
the same element-wise numpy operations, and builds the answer dicts from Python floats.

Equal by construction where it can be: element-wise operations (division, exp, log, clip, products) give the
same bits in any layout; max and argmax do not depend on order; numpy's sum of a contiguous 1-D array of fewer
than 8 elements adds them one after another from 0.0, which `_fold` does column by column (8 or more options:
pairwise summation, so such a state goes to laya's own function). A batch of one state (a 1-row call) has
nothing to share: `Decoder._row` computes its rows in Python floats, each float32 operation done in double and
rounded to float32 (the correctly rounded float32 result, as numpy's), numpy called only for exp and log.
Checked, not assumed: before its first use in a process, `Decoder` compares its answers with laya's own
`_decode_answers` on a fixed set of batches (every question type, 1 to 7 options, shuffled option orders,
extreme logits; five states and one), and where they differ in one bit it
hands every call to laya's function (logged). Anything else it does not handle (a `lang`, more options, a
batch not laid out as `predict_batch` lays it out; for one state, logits not float32, a temperature that is a
numpy scalar, a value that is not finite) is laya's function too.
"""
from __future__ import annotations

import json
import logging
import math
import struct
import threading
from itertools import chain, repeat
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

from .. import laya_internals as laya_api

log = logging.getLogger(__name__)

MAX_FOLD = 8  # numpy sums a contiguous 1-D array of fewer elements strictly left to right (pairwise beyond)
_F32 = struct.Struct("f")
_LOW = _F32.unpack(_F32.pack(1e-12))[0]  # np.clip's lower bound 1e-12 as numpy casts it for a float32 array

_CHECKED: Dict[str, bool] = {}  # "decode": whether this process's numpy gives laya's answers here
_CHECK_LOCK = threading.Lock()


def _fold(a: np.ndarray) -> np.ndarray:
    """Row sums of a 2-D array of fewer than MAX_FOLD columns, as numpy sums each row alone: 0.0 plus each element
    in turn, in the array's dtype. `add.accumulate` adds left to right from the first element; the same partial
    sums as from 0.0, but for the sign of a zero, which the final + 0.0 makes +0.0 as numpy's sum from 0.0 does."""
    return np.add.accumulate(a, axis=1)[:, -1] + 0.0


def _f32(x: float) -> float:
    """`x` rounded to float32 (OverflowError past its range). An operation on two float32 values done in double
    and rounded so is numpy's float32 operation: double carries more than twice float32's bits, so for +, -, *
    and / the one rounding to float32 gives the correctly rounded float32 result."""
    return _F32.unpack(_F32.pack(x))[0]


def _clamp01(v: float) -> float:
    return 0.0 if v < 0.0 else (1.0 if v > 1.0 else v)


_FOURS = repeat(4)  # round's second argument, for map(round, values, _FOURS)
_ITEM_KEYS = frozenset(("ids", "markers", "qtype", "options", "state_stats"))  # what Agent._encode_state's items hold
_NOT_META = ("ids", "markers", "target", "layout")  # the keys collate_items leaves out of an item's meta


COLLATE_ROWS = 16  # fewer rows: laya's row-by-row loop costs less than the masked assignments' fixed numpy calls


def collate(stock: Callable, batch: Any, pad_id: Any) -> Any:
    """laya's `collate_items(batch, pad_id)` for the items `Agent._encode_state` makes (no training target, label
    or parallel layout, and at least COLLATE_ROWS rows: anything else is laya's function): the same arrays, filled
    by one masked assignment each instead of a row at a time. A row's values land where laya puts them: row-major
    order, so the row's first len(ids) places, and the rest is laya's padding (pad_id, 0, False)."""
    if type(batch) is not list or not all(type(group) is list for group in batch):  # nothing consumed here
        return stock(batch, pad_id)
    items = [it for group in batch for it in group]
    n = len(items)
    if n < COLLATE_ROWS:
        return stock(batch, pad_id)
    for it in items:
        if (type(it) is not dict or not it.keys() <= _ITEM_KEYS or type(it.get("ids")) is not list
                or type(it.get("markers")) is not list or "qtype" not in it):
            return stock(batch, pad_id)
    rows = [it["ids"] for it in items]
    marks = [it["markers"] for it in items]
    row_lens, mark_lens = list(map(len, rows)), list(map(len, marks))
    lens, klens = np.array(row_lens, dtype=np.int64), np.array(mark_lens, dtype=np.int64)
    width, kmax = max(row_lens), max(mark_lens)
    valid = np.arange(width) < lens[:, None]
    ids = np.full((n, width), pad_id, dtype=np.int64)
    ids[valid] = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=sum(row_lens))
    mmask = np.arange(kmax) < klens[:, None]
    mpos = np.zeros((n, kmax), dtype=np.int64)
    mpos[mmask] = np.fromiter(chain.from_iterable(marks), dtype=np.int64, count=sum(mark_lens))
    return {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(valid.astype(np.int64)),
        "marker_pos": torch.from_numpy(mpos),
        "marker_mask": torch.from_numpy(mmask),
        "qtype": torch.from_numpy(np.array([it["qtype"] for it in items], dtype=np.int64)),
        "label": torch.from_numpy(np.full(n, -1, dtype=np.int64)),
        "meta": [{k: v for k, v in it.items() if k not in _NOT_META} for it in items],
    }


class _Block:
    """One question's numbers for every state of a batch: row s is state s's row of that question."""

    __slots__ = ("k", "t", "qt", "probs", "pmax", "argmax", "confidence", "score", "bucket", "keys", "legend",
                 "levels", "shown")


class Decoder:
    """`Agent._decode_answers` for one agent, the numbers computed per batch (module docstring)."""

    def __init__(self, agent: Any, count: Optional[Callable[..., None]] = None):
        self.agent = agent
        self.count = count  # HostPath._count: questions decoded in blocks, states left to laya's function
        self.stock: Callable = laya_api.stock_decode(agent)
        self.binning, self.temp_bucket, self.qtypes, self.render = laya_api.decode_helpers()

    def __call__(self, cache: Dict[str, Any], logits: Any, act: Any, items: List[Dict], ids: List[str],
                 internal: Dict[str, Dict], offset: int, lang: Optional[str] = None) -> Dict[str, Any]:
        """The answers of the state whose rows start at `offset`; `cache` is the call's (it keeps the batch's
        blocks while laya decodes that batch's states)."""
        if lang or not checked(self.agent):
            if self.count is not None:
                self.count(states_decoded_by_laya=1)
            return self.stock(logits, act, items, ids, internal, offset, **({"lang": lang} if lang else {}))
        return self.decode(cache, logits, act, items, ids, internal, offset)

    def decode(self, cache: Dict[str, Any], logits: Any, act: Any, items: List[Dict], ids: List[str],
               internal: Dict[str, Dict], offset: int) -> Dict[str, Any]:
        """`__call__` without a `lang` and without the check (what the check compares with laya's function)."""
        nq = len(items)
        if (nq == 0 or len(ids) != nq or not isinstance(logits, np.ndarray) or logits.ndim != 2
                or not isinstance(act, np.ndarray) or act.ndim != 2 or offset % nq or logits.shape[0] % nq):
            if self.count is not None:
                self.count(states_decoded_by_laya=1)
            return self.stock(logits, act, items, ids, internal, offset)
        # one state: nothing to share between states; its rows in Python floats (`_row`), fewer numpy calls
        numbers = self._row if logits.shape[0] == nq else self._block
        if cache.get("logits") is not logits or cache.get("act") is not act:
            cache.clear()
            cache["logits"], cache["act"] = logits, act  # held: the batch the blocks are of
            cache["act0"] = [round(v, 4) for v in act[:, 0].tolist()]  # round(float(act[r, 0]), 4), every row
        blocks = []
        for j, qid in enumerate(ids):
            q = internal[qid]
            k = len(items[j]["markers"])
            key = (j, qid)
            block = cache.get(key)
            if block is None and key not in cache:
                block = cache[key] = numbers(logits, nq, j, q, k)
                if block is not None and self.count is not None:
                    self.count(questions_decoded_in_blocks=1)
            if block is None or block.k != k:
                if self.count is not None:
                    self.count(states_decoded_by_laya=1)
                return self.stock(logits, act, items, ids, internal, offset)
            blocks.append(block)
        s = offset // nq
        binning_map = getattr(self.agent, "binning_map", None)
        act0 = cache["act0"]
        answers: Dict[str, Any] = {}
        for j, (qid, block) in enumerate(zip(ids, blocks)):
            shown = block.shown
            if shown is None or shown[0] is not binning_map:
                shown = self._show(block, binning_map)
            _, ans, conf, main, probs = shown
            ext = {"act_probability": act0[offset + j]}
            t = block.qt
            if t == "choice":
                answers[qid] = {
                    "type": "choice",
                    "choice": main[s],
                    "probabilities": dict(zip(block.keys, probs[s])),  # the keys of a dict: unique
                    "confidence": conf[s],
                    "answer_confidence": ans[s],
                    "action": ext,
                }
            elif t == "score":
                answers[qid] = {
                    "type": "score",
                    "score": main[s],
                    "legend": dict(block.legend),
                    "probabilities": dict(zip(block.levels, probs[s])),  # "0", "1", ...: unique
                    "confidence": conf[s],
                    "answer_confidence": ans[s],
                    "action": ext,
                }
            else:
                answers[qid] = {
                    "type": "noul",
                    "noul": main[s],
                    "confidence": conf[s],
                    "answer_confidence": ans[s],
                    "action": ext,
                }
        return answers

    def _show(self, b: _Block, binning_map: Any) -> tuple:
        """What the answers show of a block, for every state of the batch at once: (binning_map, answer
        confidences, confidences, the choice, score or noul value, rounded probabilities), each as laya's
        `_decode_answers` computes it for a row (the same rounding of the same numbers, a pass over the batch's
        values instead of a state at a time)."""
        raw = [1.0] * len(b.pmax) if b.k < 1 else list(map(_clamp01, b.pmax))
        if binning_map:
            ans = [round(self.binning(v, b.bucket, binning_map), 4) for v in raw]
        else:
            ans = list(map(round, raw, _FOURS))  # round(v, 4) each, without a Python frame per value
        if b.qt == "noul":
            p1 = [p[1] for p in b.probs]
            main = list(map(round, p1, _FOURS))
            conf = [round(max(v, 1.0 - v), 4) for v in p1]
            probs = None
        else:
            conf = list(map(round, b.confidence, _FOURS))
            main = list(map(b.keys.__getitem__, b.argmax)) if b.qt == "choice" else list(map(round, b.score, _FOURS))
            probs = [list(map(round, p, _FOURS)) for p in b.probs]
        b.shown = (binning_map, ans, conf, main, probs)
        return b.shown

    def _new_block(self, q: Dict, k: int, width: int) -> Optional[_Block]:
        """A block for question q of k options (of `width` logit columns): its temperature, option keys and a
        score's legend, the numbers still to compute (None: a question laya's function decodes)."""
        if (not 1 <= k < MAX_FOLD or k > width or q.get("t") not in ("choice", "score", "noul")
                or q["t"] == "noul" and k < 2):
            return None
        order = q.get("option_order")
        if order is not None and len(order) == k and sorted(int(i) for i in order) != list(range(k)):
            return None  # not a permutation: laya's own unpermute_probs decides what that means
        qt = self.qtypes[q["t"]]
        b = _Block()
        b.k = k
        b.qt = q["t"]
        b.shown = None
        b.bucket = self.temp_bucket(qt, k)
        b.t = self.agent.temperature_by_options.get(b.bucket, self.agent.temperature[qt])
        b.keys = list(q["crit"].keys()) if q["t"] == "choice" else None
        if q["t"] == "score":
            b.legend = {str(i): self.render(c) for i, c in enumerate(q["crit"])}
            b.levels = [str(i) for i in range(k)]
        else:
            b.legend = b.levels = None
        return b

    def _block(self, logits: np.ndarray, nq: int, j: int, q: Dict, k: int) -> Optional[_Block]:
        """Question j's numbers over rows j, j + nq, ... (None: laya's function decodes it)."""
        b = self._new_block(q, k, logits.shape[1])
        if b is None:
            return None
        order = q.get("option_order")
        raw = np.ascontiguousarray(logits[j::nq, :k])
        z = raw / b.t                                  # laya: raw_rows[j] / t_scale
        e = np.exp(z - z.max(axis=1, keepdims=True))   # p = np.exp(z - z.max())
        p = e / _fold(e)[:, None]                      # p /= p.sum()
        if order is not None and len(order) == k:      # unpermute_probs
            canonical = np.empty_like(p)
            canonical[:, np.asarray(order, dtype=int)] = p
            p = canonical
        b.pmax = p.max(axis=1).tolist()                # answer_confidence: float(p[:k].max())
        b.argmax = p.argmax(axis=1).tolist()
        if k < 2:                                      # confidence_from_probs
            b.confidence = [1.0] * p.shape[0]
        else:
            # np.clip(pk, 1e-12, 1.0): the same bounds as the same dtype, NaN kept; the ufuncs without clip's wrapper
            ent = _fold(p * np.log(np.minimum(np.maximum(p, 1e-12), 1.0))).tolist()
            log_k = math.log(k)
            b.confidence = [_clamp01(1.0 - (-e_) / log_k) for e_ in ent]
        b.score = _fold(np.arange(k) * p).tolist() if q["t"] == "score" else None
        b.probs = p.tolist()
        return b


    def _row(self, logits: np.ndarray, nq: int, j: int, q: Dict, k: int) -> Optional[_Block]:
        """`_block` for a batch of one state: row j's numbers in Python floats rounded to float32 as numpy's
        float32 operations round (`_f32`), numpy called only for exp and log (its own float32 functions, on an
        array of the same k values as laya's). Only where that is laya's arithmetic: float32 logits, a Python
        number for the temperature (numpy then divides in float32), finite values (Python's max is numpy's
        there); else None (laya's function)."""
        b = self._new_block(q, k, logits.shape[1]) if logits.dtype == np.float32 else None
        # a numpy scalar temperature is not a weak scalar: laya's arithmetic is then in its dtype
        if b is None or type(b.t) not in (float, int):
            return None
        order = q.get("option_order")
        raw = logits[j, :k].tolist()
        if not all(math.isfinite(v) for v in raw):
            return None
        try:
            t = _f32(b.t)                                       # the Python number as numpy casts it (float32)
            z = [_f32(v / t) for v in raw]                      # z = raw_rows[j] / t_scale
            m = max(z)
            e = np.exp(np.array([_f32(v - m) for v in z], dtype=np.float32)).tolist()  # np.exp(z - z.max())
            total = 0.0
            for v in e:                                         # p.sum(): left to right from 0.0, in float32
                total = _f32(total + v)
            p = [_f32(v / total) for v in e]                    # p /= p.sum()
        except (OverflowError, ZeroDivisionError):
            return None
        if order is not None and len(order) == k:               # unpermute_probs
            canonical = [0.0] * k
            for slot, i in enumerate(order):
                canonical[int(i)] = p[slot]
            p = canonical
        pmax = max(p)
        b.pmax, b.argmax = [pmax], [p.index(pmax)]              # max and the first argmax, as numpy's
        if k < 2:
            b.confidence = [1.0]
        else:                                                   # confidence_from_probs, in float32
            logs = np.log(np.array([min(max(v, _LOW), 1.0) for v in p], dtype=np.float32)).tolist()
            ent = 0.0
            for v, lg in zip(p, logs):
                ent = _f32(ent + _f32(v * lg))
            b.confidence = [_clamp01(1.0 - (-ent) / math.log(k))]
        if q["t"] == "score":                                   # np.arange(k) * p: int64 by float32, in float64
            score = 0.0
            for i, v in enumerate(p):
                score += i * v
            b.score = [score]
        else:
            b.score = None
        b.probs = [p]
        return b


def checked(agent: Any) -> bool:
    """Whether `Decoder` gives laya's answers bit for bit on this machine's numpy (compared once per process)."""
    got = _CHECKED.get("decode")
    if got is not None:
        return got
    with _CHECK_LOCK:
        if "decode" not in _CHECKED:
            try:
                diff = self_check(agent)
            except Exception as e:  # noqa: BLE001 - whatever went wrong, laya's own function decodes
                diff = "%s: %s" % (type(e).__name__, e)
            if diff:
                log.info("laya-aot: laya's own answer decoding (the batched one differs here: %s)", diff)
            _CHECKED["decode"] = not diff
    return _CHECKED["decode"]


def check_ahead(agent: Any) -> None:
    """Compare the batched decoding with laya's (`checked`, once per process) in a thread while the
    artifact loads: otherwise the first answer pays for it (tens of ms); a call that comes first waits for it.
    Nothing where this laya lacks what the host path relies on (`host_path.install` then installs none)."""
    if laya_api.check(routes=("host_path",)):
        return
    threading.Thread(target=checked, args=(agent,), daemon=True, name="laya-aot-decode-check").start()


def check_cases(seed: int = 0, states: int = 5):
    """Batches that exercise every branch: (logits, act, items, ids, internal) with every question type, 1 to 7
    options, shuffled option orders, and logits from ties to extremes."""
    rng = np.random.default_rng(seed)
    internal: Dict[str, Dict] = {}
    for k in range(1, MAX_FOLD):
        internal["c%d" % k] = {"t": "choice", "ins": "x", "crit": {"o%d" % i: None for i in range(k)}}
        internal["s%d" % k] = {"t": "score", "ins": "x", "crit": ["level %d" % i for i in range(k)]}
        order = [int(i) for i in rng.permutation(k)]
        internal["o%d" % k] = {"t": "choice", "ins": "x", "crit": {"p%d" % i: None for i in range(k)},
                               "option_order": order}
    internal["n"] = {"t": "noul", "ins": "x", "crit": None}
    internal["nr"] = {"t": "noul", "ins": "x", "crit": None, "option_order": [1, 0]}
    ids = list(internal)
    ks = [2 if internal[q]["t"] == "noul" else len(internal[q]["crit"]) for q in ids]
    items = [{"markers": list(range(k)), "qtype": 0} for k in ks]
    width = max(ks) + 1
    cases = []
    for scale in (1e-3, 1.0, 8.0, 60.0, 1e4):
        logits = (rng.standard_normal((states * len(ids), width)) * scale).astype(np.float32)
        logits[::7] = logits[::7].round()  # ties
        act = rng.random((states * len(ids), 4)).astype(np.float32)
        cases.append((logits, act, items, ids, internal))
    return cases


def self_check(agent: Any) -> Optional[str]:
    """The first difference between `Decoder` and laya on `check_cases` (None: none): its answers against laya's
    `_decode_answers`, and, since those are rounded to 4 decimals, each block's numbers before rounding against
    the lines of `_decode_answers` run row by row with laya's own functions; batches of five states (`_block`)
    and of one (`_row`, which declines an agent's numpy temperatures: laya's function then decodes)."""
    stock = laya_api.stock_decode(agent)
    dec = Decoder(agent)
    for logits, act, items, ids, internal in check_cases() + check_cases(seed=1, states=1):
        one = logits.shape[0] == len(ids)
        cache: Dict[str, Any] = {}
        for offset in range(0, logits.shape[0], len(ids)):
            with np.errstate(all="ignore"):
                want = stock(logits, act, items, ids, internal, offset)
                got = dec.decode(cache, logits, act, items, ids, internal, offset)
            if json.dumps(got) != json.dumps(want):
                return "the answers of row %d of a batch of %d" % (offset, logits.shape[0])
        for j, qid in enumerate(ids):
            block = cache.get((j, qid))
            if block is None:
                if one:
                    continue
                return "question %s was not decoded in a block" % qid
            with np.errstate(all="ignore"):
                why = _block_differs(block, logits, len(ids), j, internal[qid])
            if why:
                return "%s of question %s" % (why, qid)
    return None


def _block_differs(b: _Block, logits: np.ndarray, nq: int, j: int, q: Dict) -> Optional[str]:
    """Where a block's numbers differ from `_decode_answers`' lines on each of its rows (None: nowhere)."""
    answer_confidence, confidence_from_probs, unpermute_probs = laya_api.decode_numbers()
    k = b.k
    for s, r in enumerate(range(j, logits.shape[0], nq)):
        z = logits[r, :k] / b.t
        p = np.exp(z - z.max())
        p /= p.sum()
        p = unpermute_probs(p, q.get("option_order"))
        want = [[float(v) for v in p], answer_confidence(p, k), int(p.argmax()), confidence_from_probs(p, k)]
        got = [b.probs[s], _clamp01(b.pmax[s]), b.argmax[s], b.confidence[s]]
        if q["t"] == "score":
            want.append(float((np.arange(k) * p).sum()))
            got.append(b.score[s])
        if json.dumps(got) != json.dumps(want):
            return "the numbers of state %d" % s
    return None
