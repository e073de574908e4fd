"""The laya `Backend` that runs a bundle's artifact in place of `DecisionModel.forward`.

laya's Agent keeps tokenisation, collation, calibration and decoding; this backend takes the collated
batch, pads or chunks it to what the artifact accepts (`laya_aot.padding`), and sends what the artifact
cannot take to laya's eager forward, counted in `stats`. Near-ties: by default every row is the
artifact's answer, backed by its decision statement (`tolerance.decision_statement`); for audits,
"call" recomputes a call with a row inside `tolerance.tie_margin` with laya's eager forward, "rows"
only those rows. Every eager path goes through `stock_forward`, which builds the eager module on need.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import laya_internals as laya_api
from ..errors import LayaAotError, count_from_now, out_of_memory
from ..kinds import Runner
from ..laya_internals import Backend
from ..manifest import Artifact, VerifyResult
from ..padding import CHUNK_TOKENS, Ranges, chunks, for_runner, near_tie_rows, pad_batch
from .session import DEFAULT_NEAR_TIES, NEAR_TIE_MODES, near_tie_mode  # noqa: F401 - also read from here (serve)

log = logging.getLogger(__name__)


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """`x`, copied if its data does not start on a 16-byte boundary: an AOTInductor package assumes its inputs
    do, and copies a row slice that does not (a half after running out of memory) itself, warning on every call
    ("Input 3 was compiled as 16-bytes aligned, but it is not aligned at run time", seen on an H100)."""
    return x if x.data_ptr() % 16 == 0 else x.clone()


def _on(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`x.to(device)`, without the call where `x` is there already (a 1-row call makes a dozen of them)."""
    return x if x.device == device else x.to(device)


class TokenIdError(LayaAotError, IndexError):
    """A token id past the encoder's embedding rows (a tokenizer grown without resizing the embeddings)."""


class TokenIds:
    """The one check of a batch's token ids against the encoder's embedding rows, made before any native code or
    laya's eager forward sees them, on every path (an artifact's, and laya's eager forward as a fallback): native
    code indexing past its table ends the process (an AOTInductor package on the CPU aborts) or the CUDA context,
    so such an id is one `TokenIdError` naming the cause and the fix instead. Where the ids are on the CPU the
    check costs microseconds and runs on every call; on a device (where reading the ids back would wait for it)
    it runs where laya's tokenizer can make ids past the rows (`laya_internals.embedding_rows_short`)."""

    def __init__(self, agent: Any):
        self.agent = agent
        self.rows = laya_api.embedding_rows(agent)  # None: nothing to check against (a stand-in agent)
        self.on_device = laya_api.embedding_rows_short(agent) is not None

    def check(self, input_ids: torch.Tensor) -> None:
        if self.rows is None or not input_ids.numel() or input_ids.device.type != "cpu" and not self.on_device:
            return
        low, top = (int(v) for v in torch.aminmax(input_ids))  # one reduction for both
        if top < self.rows and low >= 0:
            return
        bad = top if top >= self.rows else low
        tok = getattr(self.agent, "tok", None)
        source = getattr(tok, "__dict__", {}).get("_source")
        raise TokenIdError(
            "token id %d is past the encoder's %d embedding rows: this checkpoint's tokenizer has %d tokens%s "
            "(tokens were added without resizing the embeddings; laya's own forward cannot embed it either). "
            "Resize the encoder's embeddings to the tokenizer (resize_token_embeddings) and save the checkpoint "
            "again, or remove the added tokens" % (
                bad, self.rows, len(tok) if tok is not None else -1,
                "" if source is None else " (read from its tokenizer files as laya-aot's snapshot %s proved, and "
                "checked against them: if you did not change those files, delete that cache entry and report "
                "this)" % source))


class AOTBackend(Backend):
    """An artifact from a laya-aot bundle installed as the agent's forward."""

    def __init__(self, agent, runner: Runner, art: Artifact, pad_id: int,
                 rejected: Optional[List[Tuple[str, str]]] = None, load_stats: Optional[Dict[str, Any]] = None,
                 near_ties: Any = DEFAULT_NEAR_TIES, eager_module: Any = None, chunk_tokens: int = CHUNK_TOKENS):
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
        self._near_ties = near_tie_mode(near_ties)
        self._margin: Optional[Tuple[VerifyResult, Optional[float]]] = None
        # builds laya's eager module on first need when the agent was loaded thin (None: it exists)
        self.eager_module = eager_module
        self.host_path: Any = None  # runtime/host_path.HostPath, once the loader installs it
        self.handover: Any = None  # runtime/handover.Handover: the artifact taking over from this one, or from
        #                            which this one took over (its `stats` are also load_stats["handover"])
        self.after_first_call: Any = None  # called once, after this backend's first call (the hand-over's start)
        self.chunk_tokens = int(chunk_tokens)  # padded tokens per artifact call (padding.chunks; 0: max_rows only)
        self.token_ids = TokenIds(agent)  # checked before the artifact or laya's eager forward sees them
        count_from_now(torch.device(runner.device))

    @property
    def near_ties(self) -> str:
        """Who decides near-ties: "call", "rows" or "off" (see the module's docstring)."""
        return self._near_ties

    @near_ties.setter
    def near_ties(self, value: Any) -> None:
        self._near_ties = near_tie_mode(value)

    @property
    def tie_margin(self) -> Optional[float]:
        """Rows whose top two option probabilities are closer than this go to laya's eager forward (None: off)."""
        if self._near_ties == "off" or self.verify is None:
            return None
        cached = self._margin
        if cached is None or cached[0] is not self.verify:  # the loader may replace verify (verified here)
            cached = self._margin = (self.verify, self.verify.tie_margin())
        return cached[1]

    @property
    def stats(self) -> Dict[str, Any]:
        """Calls served by the artifact, chunks run, eager calls by reason, and CUDA graph use."""
        with self._lock:
            out: Dict[str, Any] = dict(self._counts)
        graphs = getattr(self.runner, "graphs", None)
        if graphs is not None:
            out["cuda_graphs"] = graphs.stats
        if self.host_path is not None:
            out["host_path"] = self.host_path.stats
        return out

    def reset_stats(self) -> None:
        """Forget the calls so far (the loader's smoke check is not traffic)."""
        with self._lock:
            self._counts.clear()

    def _count(self, **kw: int) -> None:
        with self._lock:
            counts = self._counts
            for name, n in kw.items():
                counts[name] += n

    def forward(self, input_ids, attention_mask, marker_pos, marker_mask, qtype, detach_encoder=False, **extra):
        out, by_artifact = self._forward(input_ids, attention_mask, marker_pos, marker_mask, qtype, detach_encoder,
                                         **extra)
        then = self.after_first_call
        if then is not None:
            self.after_first_call = None
            then()
        margin = self.tie_margin
        if not by_artifact or margin is None:
            return out
        rows = near_tie_rows(out[0], marker_mask, margin)
        if rows.numel() == 0:
            return out
        if self._near_ties == "call":  # laya's own outputs for the whole batch, as laya would have run it
            self._count(near_tie_calls=1, near_tie_rows=int(rows.numel()), near_tie_whole_calls=1)
            return self.stock_forward(input_ids, attention_mask, marker_pos, marker_mask, qtype, detach_encoder)
        rows = rows.to(input_ids.device)
        lo, ac = self.stock_forward(input_ids[rows], attention_mask[rows], marker_pos[rows], marker_mask[rows],
                                    qtype[rows], detach_encoder)
        # copies: the artifact's outputs may be views of a CUDA graph's static buffers
        logits = out[0].to(torch.promote_types(out[0].dtype, lo.dtype), copy=True)
        acts = out[1].to(torch.promote_types(out[1].dtype, ac.dtype), copy=True)
        logits[rows] = lo.to(logits.dtype)
        acts[rows] = ac.to(acts.dtype)
        self._count(near_tie_calls=1, near_tie_rows=int(rows.numel()))
        return logits, acts

    def host_call(self, b: Dict[str, torch.Tensor]) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """The outputs, on the host, for laya's collated batch `b` still on the host; None where laya's own
        `_infer` is to run it (it moves each input to the GPU apart, each copy waited for, then calls `forward`).

        Taken where the artifact alone answers and its runner takes host inputs: a CUDA graph's replay copies them
        straight into its buffers, so a short call's inputs cross once, padded on the host, and its outputs come
        back where laya reads them next (on an H100, laya's copies were a fifth of a 1-row call's host time). laya's
        eager forward (near-ties re-run, a batch past the export range) needs the inputs on its device under
        laya's autocast: those calls stay laya's."""
        ids, mpos = b["input_ids"], b["marker_pos"]
        if (not getattr(self.runner, "takes_host_inputs", False) or ids.device.type != "cpu"
                or self.tie_margin is not None or self.ranges.out_of_range(ids.shape[1], mpos.shape[1])):
            return None
        return self.forward(ids, b["attention_mask"], mpos, b["marker_mask"], b["qtype"])

    def stock_forward(self, *args, **kwargs):
        """laya's eager forward; for a thin agent, its eager module's (built on this first need)."""
        if self.eager_module is not None:
            return self.eager_module.ensure("a call that laya's eager forward answers")(*args, **kwargs)
        return super().stock_forward(*args, **kwargs)

    def artifact_forward(self, input_ids, attention_mask, marker_pos, marker_mask, qtype, detach_encoder=False,
                         **extra):
        """The artifact's own outputs for the batch, near-ties included (laya's eager forward where the
        artifact cannot take the batch at all): what the loader's smoke check compares."""
        return self._forward(input_ids, attention_mask, marker_pos, marker_mask, qtype, detach_encoder, **extra)[0]

    def _forward(self, input_ids, attention_mask, marker_pos, marker_mask, qtype, detach_encoder, **extra):
        """(outputs, whether the artifact computed them)."""
        self.token_ids.check(input_ids)
        if extra:  # position_ids / option_ids: the parallel option layout only the eager forward reads
            self._count(eager_calls=1, eager_parallel_layout=1)
            return self.stock_forward(input_ids, attention_mask, marker_pos, marker_mask, qtype,
                                      detach_encoder, **extra), False
        n, t = input_ids.shape
        k = marker_pos.shape[1]
        why = self.ranges.out_of_range(t, k)
        if why:
            self._count(**{"eager_calls": 1, "eager_" + why.split(">")[0]: 1})
            return self.stock_forward(input_ids, attention_mask, marker_pos, marker_mask, qtype, detach_encoder), False
        batch = pad_batch((input_ids, attention_mask, marker_pos, marker_mask, qtype), self.ranges, self.pad_id)
        dev = self.runner.device
        pieces = list(chunks(n, self.ranges, batch[0].shape[1], self.chunk_tokens))
        outs: List[Any] = []
        if len(pieces) == 1:  # the whole batch in one call (the common case): no row slices, one count
            # a runner that takes host inputs moves them itself (a CUDA graph copies them straight into its
            # buffers); pieces below go to the device first, so that their outputs stay there until the last
            one = input_ids.device if getattr(self.runner, "takes_host_inputs", False) else dev
            try:
                lo, ac = self._call(batch, one)
            except RuntimeError as e:
                outs = self._halves_after(e, batch, slice(0, batch[0].shape[0]), dev)
            else:
                with self._lock:
                    self._counts["artifact_calls"] += 1
                    self._counts["chunks"] += 1
                out_dev = input_ids.device
                if lo.shape[1] != k:
                    lo = lo[:, :k]
                return (_on(lo, out_dev), _on(ac, out_dev)), True
        else:
            for rows in pieces:
                outs += self._rows(batch, rows, dev)
        logits = [lo[:, :k] for lo, _ in outs]
        acts = [ac for _, ac in outs]
        self._count(artifact_calls=1, chunks=len(outs))
        out_dev = input_ids.device
        return (torch.cat(logits).to(out_dev), torch.cat(acts).to(out_dev)), True

    def _call(self, piece: Tuple[torch.Tensor, ...], where: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """The runner's outputs for the rows of `piece` (padded): a call its CUDA graphs replay is padded to its
        stepped shape first (`padding.for_runner`), its extra rows' outputs dropped here."""
        n, t = piece[0].shape
        stepped = for_runner(piece, self.runner, self.ranges, self.pad_id)
        if stepped is not piece:
            self._count(stepped_calls=1, stepped_cells=stepped[0].numel() - n * t)
        lo, ac = self.runner(*[_aligned(_on(x, where)) for x in stepped])
        return (lo[:n], ac[:n]) if lo.shape[0] != n else (lo, ac)

    def _rows(self, batch: Tuple[torch.Tensor, ...], rows: slice, dev: torch.device) -> List[Any]:
        """The runner's outputs for `rows` of the padded batch, in one piece or, after running out of memory,
        in halves (`_halves_after`)."""
        try:
            return [self._call(tuple(x[rows] for x in batch), dev)]
        except RuntimeError as e:
            return self._halves_after(e, batch, rows, dev)

    def _halves_after(self, error: RuntimeError, batch: Tuple[torch.Tensor, ...], rows: slice,
                      dev: torch.device) -> List[Any]:
        """After the device ran out of memory on `rows`, their outputs computed in two halves (each halved again
        if need be): every row is still the artifact's answer, the rows computed alone as they are in any batch
        that is not the last (rows do not see one another). One row that does not fit raises torch's
        OutOfMemoryError, which laya's own retry on the CPU catches (an AOTInductor package reports the
        allocator's out-of-memory as a bare RuntimeError, which laya would pass to the caller). Any other
        error is raised as it came."""
        if not out_of_memory(error, dev):
            raise error
        n = rows.stop - rows.start
        if n < 2:
            raise torch.cuda.OutOfMemoryError("%s ran out of memory on %s for one row: %s"
                                              % (self.artifact.name, dev, error)) from error
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        self._count(out_of_memory_halvings=1)
        log.warning("laya-aot: %s ran out of memory on %s for %d rows; running them in two halves",
                    self.artifact.name, dev, n)
        mid = rows.start + n // 2
        return self._rows(batch, slice(rows.start, mid), dev) + self._rows(batch, slice(mid, rows.stop), dev)

    def install(self) -> None:
        """laya's install, on the agent's module as it is now: laya's retry of a request on the CPU after the GPU
        ran out of memory gives a thin agent laya's module (`EagerModule.guard_laya_switches`) and then installs
        this backend again; on the thin shell it replaced, laya's eager forward would have kept serving."""
        if self.model is not self.agent.model and not laya_api.is_thin(self.agent):
            self.model = self.agent.model
        super().install()

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
        self.token_ids = TokenIds(agent)

    def forward(self, input_ids, attention_mask, marker_pos, marker_mask, qtype, detach_encoder=False, **extra):
        """laya's forward as laya calls it, the parallel option layout's `position_ids`/`option_ids` included
        (laya's base `Backend.forward` takes the five sequential inputs only: a checkpoint with
        option_layout='parallel', which no artifact serves, failed every call with a TypeError); token ids past
        the embedding are one TokenIdError, as on an artifact's path."""
        self.token_ids.check(input_ids)
        return self.stock_forward(input_ids, attention_mask, marker_pos, marker_mask, qtype, detach_encoder, **extra)
