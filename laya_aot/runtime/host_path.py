"""laya's host path with less work per call: the same tokens from fewer tokenizer calls.

laya tokenises each state alone, and each question's head (instruction and options) once per call, though a
service asks the same questions on every call. With a bundle installed, `HostPath` keeps laya's own
`build_head` results across calls, keyed by everything `build_head` reads, and tokenises a call's states in
one batched call of the fast tokenizer (parallel in its Rust core) before laya's loop asks for them one at a
time. Within a call it fetches each question's head once and assembles every state's items from it as laya's
`build_sequence` does (`encode_state`), and collates the batch with a few numpy operations (`host_steps.collate`).
A plain call (no hooks, confidence gate or windows: most of a service's calls) is computed by
`laya_internals.plain_predict_batch` with laya's own methods, without the hook and usage machinery of
`predict_batch` that such a call cannot observe.
Each result is laya's code on laya's inputs, or equal to it (the tests compare batches and answers); anything not
prepared here is laya's stock path.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from contextvars import ContextVar
from functools import wraps
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .. import laya_internals as laya_api
from . import host_steps

log = logging.getLogger(__name__)

HEADS_KEPT = 4096  # question heads remembered per agent (a few hundred bytes each)
STATES_PREFETCHED = 4096  # at most this many states of one call are tokenised ahead (laya's own window bounds it too)
_PLAIN = {"add_special_tokens": False}  # the keywords of laya's state tokenisation (`Agent._encode_state`)

_CALL: ContextVar[Optional["_Call"]] = ContextVar("laya_aot_host_call", default=None)


class _Call:
    """One predict_batch call through a host path: its states' token ids, by the exact text laya tokenises; the
    heads it was handed, by the question object laya passed (`internal[qid]`, one per question for the call);
    the decoder's numbers for the batch being decoded. (A plain class: made on every call.)"""

    __slots__ = ("path", "many", "states", "heads", "plans", "decoded", "counts")

    def __init__(self, path: "HostPath", many: bool = True):
        self.path = path
        self.many = many  # more than one state: items assembled from the call's heads (encode_state)
        self.counts: Counter = Counter()  # what the call did, added to the path's stats once, at its end
        self.states: Dict[str, List[int]] = {}
        self.heads: Dict[tuple, Tuple[Dict, tuple]] = {}
        self.plans: Dict[tuple, Optional[tuple]] = {}
        self.decoded: Dict[Any, Any] = {}


class HostPath:
    """An agent's cache of question heads and its batched state tokenisation (see the module docstring)."""

    def __init__(self, agent: Any):
        self.agent = agent
        self.tok = agent.tok
        self._stock_encode: Callable = laya_api.stock_encode_text()
        self.encode = laya_api.state_encoder(agent.tok)  # the tokenizer's Rust call, where it is laya's call
        self.decoder = host_steps.Decoder(agent, self._count)
        # laya's predict_batch for a plain call (no hooks, gate or windows), without what such a call does not use
        self.plain = laya_api.plain_predict_batch(agent)
        if self.plain is None:
            log.info("laya-aot: laya's own predict_batch for every call (its method is not the one plain calls "
                     "were checked against)")
        self._heads: "OrderedDict[tuple, Tuple[Tuple[int, ...], Tuple[int, ...], Dict[str, Any]]]" = OrderedDict()
        self._lock = threading.Lock()
        self._counts: Counter = Counter()

    @property
    def stats(self) -> Dict[str, int]:
        """Heads served from the cache or built by laya; states tokenised ahead (batched), by the direct call when
        laya asked (direct: a call of one state, a window after the first) and by laya's own call (alone); states
        whose items were assembled from the call's heads (encoded); questions decoded in blocks (one per batch),
        and states whose answers laya's own function decoded; calls computed as plain calls (plain_calls)."""
        with self._lock:
            return dict(self._counts)

    def head(self, stock: Callable, tok: Any, q: Dict, head_max_len: int,
             option_order: Optional[Sequence[int]], call: Optional[_Call] = None
             ) -> Tuple[List[int], List[int], Dict[str, Any]]:
        """laya's `build_head(tok, q, head_max_len, option_order)`, from the cache when laya built it before.

        Within a call, laya hands the same question object for every state: the key is then looked up by that
        object (held by the call, so its id stays its own), not rendered again. laya never changes a question
        object during a call (`internal` is made once per call)."""
        if tok is not self.tok or type(head_max_len) is not int or (
                option_order is not None and not all(type(i) is int for i in option_order)):
            # a key must hold what build_head reads as it reads it: 128.0 equals 128 as a key, and laya raises for it
            return stock(tok, q, head_max_len, option_order=option_order)
        order = None if option_order is None else tuple(option_order)
        if call is not None:
            seen = call.heads.get((id(q), head_max_len, order))
            if seen is not None and seen[0] is q:
                self._count(heads_cached=1)
                ids, markers, stats = seen[1]
                return list(ids), list(markers), dict(stats)
        # everything build_head reads: the type, the instruction and the rendered options (render_options
        # raises here exactly as build_head would), the order and the budget; the tokenizer is this agent's
        key = (q["t"], str(q["ins"]), tuple(laya_api.render_options(q)), head_max_len, order)
        with self._lock:
            hit = self._heads.get(key)
            if hit is not None:
                self._heads.move_to_end(key)
            self._counts["heads_cached" if hit is not None else "heads_built"] += 1
        if hit is None:
            ids, markers, stats = stock(tok, q, head_max_len, option_order=option_order)
            hit = (tuple(ids), tuple(markers), dict(stats))
            with self._lock:
                self._heads[key] = hit
                while len(self._heads) > HEADS_KEPT:
                    self._heads.popitem(last=False)
        if call is not None:
            call.heads[(id(q), head_max_len, order)] = (q, hit)
        ids, markers, stats = hit
        return list(ids), list(markers), dict(stats)  # laya's callers get lists of their own, as from laya

    def state_ids(self, call: _Call, stock: Callable, tok: Any, text: Any, kwargs: Dict[str, Any]) -> Any:
        """laya's state tokenisation (`encode_text(tok, text, add_special_tokens=False)`): prepared ahead, else
        the tokenizer's direct call on this one text (laya's call of one text is its batched call of `[text]`,
        `laya_internals.state_encoder`), else laya's own call."""
        counts = call.counts
        if tok is not self.tok or kwargs != _PLAIN or not isinstance(text, str):
            counts["states_alone"] += 1
            return stock(tok, text, **kwargs)
        ids = call.states.get(text)
        if ids is not None:
            counts["states_batched"] += 1
            return {"input_ids": list(ids)}  # a list of its own: a state repeated in the call is asked for again
        encoded = self.encode([text]) if self.encode is not None else None
        if encoded is None:  # no direct call, or the backend not as laya's call would leave it: laya's call
            counts["states_alone"] += 1
            return stock(tok, text, **kwargs)
        counts["states_direct"] += 1
        return {"input_ids": encoded[0]}

    def encode_state(self, stock: Callable, state: Any, ids: List[str], internal: Dict[str, Dict],
                     max_len: Optional[int] = None, head_max_len: Optional[int] = None) -> List[Dict]:
        """laya's `Agent._encode_state`: each question's item assembled as `build_sequence` assembles it, from the
        question's head fetched once per call (`_plan`) rather than once per state and question. Anything else
        (outside a call, a state laya cannot serialise, a question whose options do not fit: laya raises its
        own error) is laya's method."""
        call = _CALL.get()
        if call is None or call.path is not self or not call.many:  # one state: each head is asked for once anyway
            return stock(state, ids, internal, max_len=max_len, head_max_len=head_max_len)
        cfg_len, cfg_head, sep, qtypes = laya_api.sequence_parts(self.agent)
        max_len = cfg_len if max_len is None else max_len
        head_max_len = cfg_head if head_max_len is None else head_max_len
        plans = []
        reused = 0
        for qid in ids:
            q = internal[qid]
            plan = call.plans.get((id(q), max_len, head_max_len))
            if plan is None or plan[0] is not q:
                plan = self._plan(call, q, max_len, head_max_len, qtypes)
                if plan is None:
                    return stock(state, ids, internal, max_len=max_len, head_max_len=head_max_len)
            else:
                reused += 1
            plans.append(plan)
        try:
            text = laya_api.state_text(self.tok, state)
        except Exception:  # noqa: BLE001 - laya raises its own error for this state
            return stock(state, ids, internal, max_len=max_len, head_max_len=head_max_len)
        state_ids = self.state_ids(call, self._stock_encode, self.tok, text, _PLAIN)["input_ids"]
        n = len(state_ids)
        left = isinstance(state, list)  # a conversation keeps its newest turns (laya's truncate_left)
        items = []
        for _, head, kept, stats, room, qtype in plans:
            # build_sequence: ids + st + [sep], cut to max_len (st never longer than room), markers below max_len
            st = state_ids[max(0, n - room):] if left else state_ids[:room]
            seq = [*head, *st, sep]
            if len(seq) > max_len:
                seq = seq[:max_len]
            used = len(st)
            items.append({"ids": seq, "markers": list(kept), "qtype": qtype, "options": dict(stats),
                          "state_stats": {"state_tokens": n, "state_tokens_used": used,
                                          "state_tokens_dropped": n - used, "truncated": used < n}})
        counts = call.counts
        counts["states_encoded"] += 1
        counts["heads_cached"] += reused  # heads laya's build_sequence would have asked for again
        return items

    def _plan(self, call: _Call, q: Dict, max_len: int, head_max_len: int, qtypes: Dict[str, int]
              ) -> Optional[tuple]:
        """A question's part of every item of the call: (q, head ids, the markers below max_len, the head's
        stats, the room left for the state, its qtype); None where laya raises (its options do not fit)."""
        head, markers, stats = laya_api.build_head(self.tok, q, head_max_len)
        kept = tuple(m for m in markers if m < max_len)
        if len(kept) != stats["options"]:
            call.plans[(id(q), max_len, head_max_len)] = None
            return None
        plan = (q, tuple(head), kept, stats, max(0, max_len - len(head) - 1), qtypes[q["t"]])
        call.plans[(id(q), max_len, head_max_len)] = plan
        return plan

    def decode(self, stock: Callable, logits: Any, act: Any, items: List[Dict], ids: List[str],
               internal: Dict[str, Dict], offset: int, **kwargs: Any) -> Dict[str, Any]:
        """laya's `Agent._decode_answers`, the numbers of the call's batch computed at once (host_steps)."""
        call = _CALL.get()
        if call is None or call.path is not self or (kwargs and (len(kwargs) > 1 or "lang" not in kwargs)):
            return stock(logits, act, items, ids, internal, offset, **kwargs)
        return self.decoder(call.decoded, logits, act, items, ids, internal, offset, kwargs.get("lang"))

    def prepare(self, states: Sequence[Any], batch_size: Optional[int]) -> _Call:
        """The call's states tokenised in one batched tokenizer call, as laya's `_encode_state` would text them.

        Only what laya itself holds at once: every state when it packs them all, else its first window of
        `batch_size * 8` states. A state laya cannot serialise is left to laya, which raises its own error.
        One state is not prepared: `state_ids` tokenises it when laya asks, by the same direct call, without
        serialising it twice."""
        if not isinstance(states, (list, tuple)):  # an iterator is laya's to consume; anything else laya refuses
            return _Call(self)
        n = len(states)
        call = _Call(self, many=n > 1)
        if batch_size and 0 < batch_size < n:
            n = batch_size * 8
        n = min(n, STATES_PREFETCHED)
        if n < 2:  # nothing to batch: one state gains nothing from tokenising it ahead
            return call
        try:
            texts = [laya_api.state_text(self.tok, s) for s in states[:n]]
        except Exception:  # noqa: BLE001 - laya raises its own error for this state, in its own place
            return call
        unique = list(dict.fromkeys(texts))
        encoded = self.encode(unique) if self.encode is not None else None
        if encoded is None:  # no direct call for this tokenizer, or its backend not as laya's call leaves it
            if len(unique) < 2:
                return call
            encoded = laya_api.encode_texts(self.tok, unique)
        call.states = dict(zip(unique, encoded))
        return call

    def wrap(self, predict_batch: Callable) -> Callable:
        """`predict_batch` with this host path active for the call (and the calls it makes, e.g. predict_long's)."""

        @wraps(predict_batch)
        def predict_batch_prepared(states, questions, batch_size=None, *args, **kwargs):
            if _CALL.get() is not None:  # a nested call (predict_long -> predict_batch) is prepared already
                return predict_batch(states, questions, batch_size, *args, **kwargs)
            call = self.prepare(states, batch_size)
            token = _CALL.set(call)
            try:
                if self.plain is not None and not args:
                    results = self.plain(states, questions, batch_size, kwargs)
                    if results is not None:
                        call.counts["plain_calls"] += 1
                        return results
                return predict_batch(states, questions, batch_size, *args, **kwargs)
            finally:
                _CALL.reset(token)
                if call.counts:
                    self._count(**call.counts)

        predict_batch_prepared.host_path = self  # type: ignore[attr-defined]
        return predict_batch_prepared

    def _count(self, **kw: int) -> None:
        with self._lock:
            counts = self._counts
            for name, n in kw.items():  # (Counter.update's checks cost more than the counting, per call)
                counts[name] += n


def _head(stock: Callable) -> Callable:
    @wraps(stock)
    def build_head(tok, q, head_max_len=192, option_order=None):
        call = _CALL.get()
        if call is None:
            return stock(tok, q, head_max_len, option_order=option_order)
        return call.path.head(stock, tok, q, head_max_len, option_order, call)

    return build_head


def _state(stock: Callable) -> Callable:
    @wraps(stock)
    def encode_text(tok, text, **kwargs):
        call = _CALL.get()
        if call is None:
            return stock(tok, text, **kwargs)
        return call.path.state_ids(call, stock, tok, text, kwargs)

    return encode_text


def _collate(stock: Callable) -> Callable:
    @wraps(stock)
    def collate_items(batch, pad_id):
        if _CALL.get() is None:
            return stock(batch, pad_id)
        return host_steps.collate(stock, batch, pad_id)

    return collate_items


def install(agent: Any) -> Optional[HostPath]:
    """Give `agent` a host path (None, logged, where this laya lacks what it relies on)."""
    current = getattr(agent.predict_batch, "host_path", None)
    if current is not None:
        return current
    missing = laya_api.check(routes=("host_path",))
    if missing:
        log.info("laya-aot: laya's stock host path (this laya lacks %s)", ", ".join(missing))
        return None
    laya_api.route_host_path(_head, _state, _collate)
    path = HostPath(agent)
    agent.predict_batch = path.wrap(agent.predict_batch)
    laya_api.route_decode(agent, path.decode)
    laya_api.route_encode_state(agent, path.encode_state)
    return path


def of(agent: Any) -> Optional[HostPath]:
    """The host path installed on `agent`, if any."""
    return getattr(getattr(agent, "predict_batch", None), "host_path", None)
