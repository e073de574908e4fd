"""The laya `Backend` that runs a bundle's artifact in place of `DecisionModel.forward`.

laya's Agent keeps tokenisation, collation, calibration and decoding; this backend receives the
collated batch and returns `(logits, act_logits)` with the stock forward's shapes. It pads the batch
to what the artifact accepts (`laya_aot.padding`), splits rows beyond the exported maximum into
chunks, and runs anything the artifact cannot take (the parallel option layout, more tokens or
markers than were exported) through laya's eager forward, counting each such call in `stats`.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..kinds import Runner
from ..laya_internals import Backend
from ..manifest import Artifact, VerifyResult
from ..padding import Ranges, chunks, pad_batch


class AOTBackend(Backend):
    """An artifact from a laya-aot bundle installed as the agent's forward."""

    def __init__(self, agent, runner: Runner, art: Artifact, pad_id: int,
                 rejected: Optional[List[Tuple[str, str]]] = None, load_stats: Optional[Dict[str, Any]] = None):
        super().__init__(agent)
        self.name = "aot:%s" % art.kind
        self.runner = runner
        self.artifact = art
        self.variant: Optional[str] = art.variant
        self.verify: Optional[VerifyResult] = art.verify
        self.ranges: Ranges = art.ranges
        self.pad_id = pad_id
        self.rejected = list(rejected or [])
        self.load_stats = dict(load_stats or {})
        self._counts: Counter = Counter()
        self._lock = threading.Lock()

    @property
    def stats(self) -> Dict[str, Any]:
        """Calls served by the artifact, chunks run, eager calls by reason, and CUDA graph use."""
        with self._lock:
            out: Dict[str, Any] = dict(self._counts)
        graphs = getattr(self.runner, "graphs", None)
        if graphs is not None:
            out["cuda_graphs"] = graphs.stats
        return out

    def reset_stats(self) -> None:
        """Forget the calls so far (the loader's smoke check is not traffic)."""
        with self._lock:
            self._counts.clear()

    def _count(self, **kw: int) -> None:
        with self._lock:
            self._counts.update(kw)

    def forward(self, input_ids, attention_mask, marker_pos, marker_mask, qtype, detach_encoder=False, **extra):
        if extra:  # position_ids / option_ids: the parallel option layout only the eager forward reads
            self._count(eager_calls=1, eager_parallel_layout=1)
            return self.stock_forward(input_ids, attention_mask, marker_pos, marker_mask, qtype,
                                      detach_encoder, **extra)
        n, t = input_ids.shape
        k = marker_pos.shape[1]
        why = self.ranges.out_of_range(t, k)
        if why:
            self._count(**{"eager_calls": 1, "eager_" + why.split(">")[0]: 1})
            return self.stock_forward(input_ids, attention_mask, marker_pos, marker_mask, qtype, detach_encoder)
        batch = pad_batch((input_ids, attention_mask, marker_pos, marker_mask, qtype), self.ranges, self.pad_id)
        dev = self.runner.device
        logits, acts = [], []
        n_chunks = 0
        for rows in chunks(n, self.ranges):
            lo, ac = self.runner(*(x[rows].to(dev) for x in batch))
            logits.append(lo[:, :k])
            acts.append(ac)
            n_chunks += 1
        self._count(artifact_calls=1, chunks=n_chunks)
        out_dev = input_ids.device
        logits_t = logits[0] if n_chunks == 1 else torch.cat(logits)
        acts_t = acts[0] if n_chunks == 1 else torch.cat(acts)
        return logits_t.to(out_dev), acts_t.to(out_dev)

    def __repr__(self) -> str:
        return "AOTBackend(%s, variant=%s, installed=%s)" % (self.artifact.name, self.variant, self.installed)


class EagerFallback(Backend):
    """laya's eager forward, installed when no artifact fits; it keeps the reasons for inspection."""

    name = "eager"

    def __init__(self, agent, rejected: List[Tuple[str, str]]):
        super().__init__(agent)
        self.rejected = list(rejected)
        self.artifact = None
        self.variant = None
        self.stats: Dict[str, Any] = {}
