"""The host_path route: laya's host-side steps of a call (question heads, state tokenisation, answer decoding) as
`runtime/host_path.py` and `runtime/host_steps.py` run them with less work, and the seams where they go in."""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

_HOST_ROUTED = threading.Lock()


def route_host_path(head: Callable[[Callable], Callable], state: Callable[[Callable], Callable],
                    collate: Callable[[Callable], Callable]) -> None:
    """Send laya's `build_head`, `Agent._encode_state`'s tokenizer call and `predict_batch`'s `collate_items` through
    `head(stock)`, `state(stock)` and `collate(stock)` (runtime/host_path.py), once per process. Each returns laya's
    stock function's result outside a host path's call, so other agents in the process run exactly as before."""
    import laya.agent
    import laya.common

    with _HOST_ROUTED:
        for module, name, make in ((laya.common, "build_head", head), (laya.agent, "encode_text", state),
                                   (laya.agent, "collate_items", collate)):
            stock = getattr(module, name)
            if getattr(stock, "laya_aot_stock", None) is None:
                wrapped = make(stock)
                wrapped.laya_aot_stock = stock  # type: ignore[attr-defined]
                setattr(module, name, wrapped)


def stock_decode(agent: Any) -> Callable:
    """laya's `Agent._decode_answers` bound to `agent` (whatever the instance holds in its place)."""
    import laya.agent

    return laya.agent.Agent._decode_answers.__get__(agent)


def _route(agent: Any, name: str, fn: Callable[..., Any]) -> None:
    stock = getattr(agent, name)
    setattr(agent, name, functools.wraps(stock)(functools.partial(fn, stock)))


def route_decode(agent: Any, decode: Callable[..., Any]) -> None:
    """Make this agent's answer decoding (laya's `Agent._decode_answers`) `decode(stock, *args, **kwargs)`, `stock`
    being the function the agent held."""
    _route(agent, "_decode_answers", decode)


def route_encode_state(agent: Any, encode: Callable[..., Any]) -> bool:
    """Make this agent's state encoding (laya's `Agent._encode_state`) `encode(stock, *args, **kwargs)`; False (not
    routed) where the agent's class has a method of its own, or the checkpoint uses the parallel option layout
    (whose items carry what only laya's method builds)."""
    import laya.agent

    if type(agent)._encode_state is not laya.agent.Agent._encode_state or getattr(agent, "parallel_options", True):
        return False
    _route(agent, "_encode_state", encode)
    return True


def stock_encode_text() -> Callable[..., Any]:
    """laya's own `encode_text` as `Agent._encode_state` calls it (before `route_host_path` wrapped it)."""
    import laya.agent

    return getattr(laya.agent.encode_text, "laya_aot_stock", laya.agent.encode_text)


def sequence_parts(agent: Any) -> Tuple[int, int, int, Dict[str, int]]:
    """(max_len, head_max_len, the [SEP] id, QTYPES): what `Agent._encode_state` and `build_sequence` read besides
    the question heads (the agent's token budgets as `_encode_state` defaults them)."""
    import laya.agent

    cfg = agent.cfg
    return cfg.get("max_len", 512), cfg.get("head_max_len", 192), agent.tok.sep_token_id, laya.agent.QTYPES


def build_head(tok: Any, q: Dict[str, Any], head_max_len: int) -> Tuple[List[int], List[int], Dict[str, Any]]:
    """`build_head` as `build_sequence` calls it for `Agent._encode_state` (the routed one, when routed)."""
    import laya.common

    return laya.common.build_head(tok, q, head_max_len, option_order=q.get("option_order"))


def decode_helpers() -> Tuple[Callable, Callable, Dict[str, int], Callable]:
    """(apply_binning_map, temp_bucket, QTYPES, render_criterion) as `Agent._decode_answers` calls them."""
    import laya.agent

    return laya.agent.apply_binning_map, laya.agent.temp_bucket, laya.agent.QTYPES, laya.agent.render_criterion


def decode_numbers() -> Tuple[Callable, Callable, Callable]:
    """(answer_confidence, confidence_from_probs, unpermute_probs): the functions `_decode_answers` computes with."""
    import laya.agent

    return laya.agent.answer_confidence, laya.agent.confidence_from_probs, laya.agent.unpermute_probs


def state_encoder(tok: Any) -> Optional[Callable[[List[str]], Optional[List[List[int]]]]]:
    """`encode(texts)`: exactly `tok(texts, add_special_tokens=False)["input_ids"]`, from the tokenizer's Rust
    backend directly (its `encode_batch_fast`, which skips the offsets nobody reads here), or None (the answer
    is laya's call; this tokenizer's class is not one whose call is known to be that).

    The call is known for two classes: laya-aot's `SnapshotTokenizer` (its plain call is `encode_batch` on its
    backend) and transformers' fast tokenizer class itself (its `_encode_plus` resets the backend's truncation
    and padding and sets `encode_special_tokens` to `split_special_tokens`, then calls `encode_batch`). `encode`
    runs under laya's tokenizer lock and answers None, leaving the call to laya, when the backend is not in the
    state that call would run `encode_batch` in (truncation or padding left on by an earlier call, another
    special-token setting): it never changes the shared backend."""
    import sys

    from ..tokenizer_snapshot import SnapshotTokenizer

    if type(tok) is SnapshotTokenizer:
        if not tok.__dict__.get("_right"):  # its plain call then goes to the real tokenizer
            return None
        backend = tok.__dict__.get("_backend")
        want = None  # the snapshot's call never changes its backend's setting
    else:
        module = sys.modules.get("transformers.tokenization_utils_tokenizers")
        fast_class = getattr(module, "TokenizersBackend", None) or getattr(module, "PreTrainedTokenizerFast", None)
        if fast_class is None or type(tok) is not fast_class:
            return None
        backend = tok.__dict__.get("_tokenizer")
        want = bool(getattr(tok, "split_special_tokens", False))
    run = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)
    if run is None:
        return None
    from laya.common import _TOKENIZE_LOCK

    def encode(texts: List[str]) -> Optional[List[List[int]]]:
        with _TOKENIZE_LOCK:
            if backend.truncation is not None or backend.padding is not None \
                    or (want is not None and backend.encode_special_tokens != want):
                return None
            encs = run(texts, add_special_tokens=False)
        return [e.ids for e in encs]

    return encode


def render_options(q: Dict[str, Any]) -> List[str]:
    """A normalised question's option texts, as laya's build_head renders them."""
    from laya.common import render_options as stock

    return stock(q)


def state_text(tok: Any, state: Any) -> str:
    """The text `Agent._encode_state` tokenises for `state`."""
    from laya.common import serialize_state

    return serialize_state(state).replace(tok.mask_token, " ")


def encode_texts(tok: Any, texts: List[str]) -> List[List[int]]:
    """`texts` tokenised as `Agent._encode_state` tokenises a state, in one batched call under laya's lock."""
    from laya.common import encode_text

    return encode_text(tok, texts, add_special_tokens=False)["input_ids"]


# the source of laya's `Agent.predict_batch` whose plain call `plain_predict_batch` computes: sha256 of the module
# that holds it (laya/agent.py, laya 0.4.15; the whole file, read in 0.2 ms where `inspect.getsource` of the method
# took 4.6 ms of a start). On any other source the function is not made and every call runs laya's own method
AGENT_SOURCE_SHA256 = "0d8f55fa2f1a8e8f840a0afd9f1a360c6cd1ee7c8e47701adabf92f89c139ffd"
_PLAIN_KEYWORDS = frozenset(("lang", "max_len", "head_max_len", "sort_by_length", "hooks", "on_predict_start",
                             "on_predict_end", "hooks_raise", "hooks_timeout", "min_confidence"))
_NO_HOOK_KEYWORDS = ("hooks", "on_predict_start", "on_predict_end", "hooks_raise", "hooks_timeout", "min_confidence")


@functools.lru_cache(maxsize=1)
def _agent_source_sha256() -> Optional[str]:
    """sha256 of laya/agent.py as installed (None: no source file to read)."""
    import hashlib

    import laya.agent

    try:
        with open(laya.agent.__file__, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except (OSError, TypeError):
        return None


def plain_predict_batch(agent: Any) -> Optional[Callable[..., Optional[List[Dict[str, Any]]]]]:
    """`plain(states, questions, batch_size, kwargs)`: laya's `agent.predict_batch(states, questions, batch_size,
    **kwargs)` for a plain call, else None (the call is laya's to run). None instead of the function where the
    agent's `predict_batch` is not laya's method of the source checked here (AGENT_SOURCE_SHA256).

    A plain call: no hook anywhere (the process's defaults, the agent's, the call's), no confidence gate or hook
    setting, a non-empty list of states (none None) and a non-empty dict of questions, all states in one batch.
    For such a call laya's method runs its hooks' dispatch on an empty list, its gate on None and its usage total
    for the hooks alone, and its windows and batches are one: what is left is its validation, encoding, forward,
    decoding and per-state usage, computed here with laya's own methods, in laya's order, under laya's decorators.
    `input_tokens` is the number of the state's ids: what laya sums of the attention mask `collate_items` filled
    with a 1 for each id (without the two torch calls per state)."""
    import laya.agent
    import laya.common
    import laya.hooks
    import torch

    method = laya.agent.Agent.predict_batch
    if getattr(type(agent), "predict_batch", None) is not method or _agent_source_sha256() != AGENT_SOURCE_SHA256:
        return None
    defaults = laya.hooks._DEFAULT_HOOKS
    collapsed_options = laya.agent.collapsed_options
    disable_reuse = laya.agent._disable_question_token_reuse

    @torch.no_grad()
    @laya.agent._reuse_question_tokens
    def run(states: List[Any], questions: Dict[str, Any], lang: Any, max_len: Any, head_max_len: Any
            ) -> List[Dict[str, Any]]:
        if len(states) == 1:
            disable_reuse()
        ids = list(questions.keys())
        for qid in ids:
            agent._check_question(qid, questions[qid])
        internal = {qid: agent._to_internal(questions[qid]) for qid in ids}
        overrides: Dict[str, Any] = {}
        if max_len is not None:
            overrides["max_len"] = max_len
        if head_max_len is not None:
            overrides["head_max_len"] = head_max_len
        encoded = [agent._encode_state(st, ids, internal, **overrides) for st in states]
        b = laya.agent.collate_items(encoded, agent.tok.pad_token_id)  # the module's (routed) function, as laya's
        logits, act = agent._forward(b)
        results: List[Dict[str, Any]] = []
        row = 0
        for items in encoded:
            n_tokens = sum(len(item["ids"]) for item in items)
            answers = agent._decode_answers(logits, act, items, ids, internal, row, **({"lang": lang} if lang else {}))
            stats = [item["state_stats"] for item in items]
            dropped = max(s["state_tokens_dropped"] for s in stats)
            usage = {
                "input_tokens": n_tokens,
                "output_tokens": 0,
                "state_tokens": stats[0]["state_tokens"],
                "state_tokens_dropped": dropped,
                "truncated": dropped > 0,
                "truncated_questions": [qid for qid, s in zip(ids, stats) if s["truncated"]],
            }
            collapsed = collapsed_options(ids, items)
            if collapsed:
                usage["options"] = collapsed
            results.append({"model": "laya-rl-agent", "answers": answers, "usage": usage})
            row += len(items)
        return results

    def plain(states: Any, questions: Any, batch_size: Any, kwargs: Dict[str, Any]
              ) -> Optional[List[Dict[str, Any]]]:
        if (type(states) is not list or not states or type(questions) is not dict or not questions
                or defaults or agent.hooks or not kwargs.keys() <= _PLAIN_KEYWORDS
                or type(kwargs.get("sort_by_length", False)) is not bool):
            return None
        if batch_size is not None and (type(batch_size) is not int or batch_size < len(states)):
            return None
        for name in _NO_HOOK_KEYWORDS:
            if kwargs.get(name) is not None:
                return None
        for st in states:
            if st is None:
                return None
        return run(list(states), questions, kwargs.get("lang"), kwargs.get("max_len"), kwargs.get("head_max_len"))

    return plain
