"""The shapes an exported artifact accepts, and how a collated Laya batch is padded to them.

One module for both halves: the build verifies each artifact on batches padded exactly the way the
runtime pads them, so a verified figure describes what a service will see.

Padding keeps answers unchanged: extra token columns carry the pad id with attention 0 (the encoder
and the decision head mask them), extra marker columns are masked (the head fills their logits with
-1e4, so their probability is exactly 0 in fp32), and rows are split into chunks. A call replayed from a
CUDA graph (`kinds/graphs.py` decides which) is padded further, to a stepped call shape (`Ranges.call_shape`:
rows, tokens and markers each rounded up to a `step_up` size), so that a service's calls take a few fixed
shapes: extra rows repeat the call's last real row and are dropped from the outputs (a row never sees another).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

if TYPE_CHECKING:  # torch loads when a batch is padded: the manifest (and so `laya-aot inspect`'s usage
    import torch  # line) needs only Ranges

TOKEN_MULTIPLE = 16
# the widest batch an artifact is exported for (export.max_rows); wider requests run in slices of it. The
# build refuses more and so does the manifest reader: verification builds a case of max_rows rows
MAX_ROWS = 1024
# the most padded tokens (rows x tokens) one artifact call takes by default: the forward's activations grow
# with it (32 x 1024 in one call holds 1.25 GB of them for a ModernBERT-large) while its speed stops growing
# long before (a GPU is busy at a few thousand tokens); 0 = only max_rows splits a batch
CHUNK_TOKENS = 24576


def step_up(n: int) -> int:
    """The smallest call size >= n: every size up to 8, then four steps per doubling (10, 12, 14, 16, 20, 24, 28,
    32, 40, ...). At most 25% more than `n`, and 20 sizes up to 64: a service's calls of any size take few shapes
    (each replayed from one CUDA graph) without paying much for the padding."""
    n = max(1, int(n))
    step = 1 << max(0, n.bit_length() - 3)
    return -(-n // step) * step


def context_tokens(max_len: int) -> int:
    """The most tokens an export takes for a checkpoint whose rows hold at most `max_len` tokens (laya's context):
    that context rounded up to TOKEN_MULTIPLE, so that every row laya sends, padded, is the artifact's. A context
    of 200 exports 208 tokens: 200 itself cannot be exported (tokens are 16 x Dim), and 192 would leave rows of
    193-200 tokens to laya's eager forward. The build's default and the manifest reader's bound."""
    return -(-int(max_len) // TOKEN_MULTIPLE) * TOKEN_MULTIPLE


@dataclass(frozen=True)
class Ranges:
    """Dynamic ranges of an exported program (read back from its range constraints)."""

    min_rows: int
    max_rows: int
    min_tokens: int
    max_tokens: int
    min_markers: int
    max_markers: int
    token_multiple: int = TOKEN_MULTIPLE

    def as_dict(self) -> Dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, int]) -> "Ranges":
        return cls(**{k: int(d[k]) for k in cls.__dataclass_fields__})

    def padded_tokens(self, n: int) -> int:
        m = self.token_multiple
        return max(self.min_tokens, -(-n // m) * m)

    def padded_markers(self, k: int) -> int:
        return max(self.min_markers, k)

    def call_shape(self, rows: int, tokens: int, markers: int) -> Tuple[int, int, int]:
        """The stepped shape a call of this many rows, tokens and markers is padded to where its shape must come
        from a small fixed set (a CUDA graph's): each rounded up to a `step_up` size (tokens in units of the
        token multiple) inside the artifact's ranges."""
        m = self.token_multiple
        return (min(self.max_rows, max(self.min_rows, step_up(rows))),
                min(self.max_tokens, max(self.padded_tokens(tokens), step_up(-(-tokens // m)) * m)),
                min(self.max_markers, max(self.min_markers, step_up(markers))))

    def out_of_range(self, tokens: int, markers: int) -> Optional[str]:
        """Why a call of this many tokens/markers cannot run on the artifact (None when it can)."""
        if self.padded_tokens(tokens) > self.max_tokens:
            return "tokens>%d" % self.max_tokens
        if self.padded_markers(markers) > self.max_markers:
            return "markers>%d" % self.max_markers
        return None


Batch = Tuple["torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor"]


def pad_batch(batch: Batch, ranges: Ranges, pad_id: int) -> Batch:
    """Pad tokens to the artifact's multiple (pad id, attention 0) and markers to its minimum (masked)."""
    from torch.nn.functional import pad  # one op per tensor: half a cat's host time on a 1-row call

    ids, att, mpos, mmask, qtype = batch
    t, k = ids.shape[1], mpos.shape[1]
    tp, kp = ranges.padded_tokens(t), ranges.padded_markers(k)
    if tp != t:
        ids, att = pad(ids, (0, tp - t), value=pad_id), pad(att, (0, tp - t))
    if kp != k:
        mpos, mmask = pad(mpos, (0, kp - k)), pad(mmask, (0, kp - k))
    return ids, att, mpos, mmask, qtype


def pad_call(batch: Batch, shape: Tuple[int, int, int], pad_id: int, one_token_rows: bool = False) -> Batch:
    """`batch` (already `pad_batch`ed) padded to `shape` (rows, tokens, markers) from `Ranges.call_shape`: tokens
    and markers as `pad_batch` pads them; extra rows repeat the last row, whose outputs the caller drops. With
    `one_token_rows` (a runner of packed rows, which computes each row's own tokens) an extra row is one pad
    token with no marker instead: a repeated row would be computed again."""
    import torch
    from torch.nn.functional import pad

    ids, att, mpos, mmask, qtype = batch
    n, t, k = ids.shape[0], ids.shape[1], mpos.shape[1]
    rows, tokens, markers = shape
    if tokens != t:
        ids, att = pad(ids, (0, tokens - t), value=pad_id), pad(att, (0, tokens - t))
    if markers != k:
        mpos, mmask = pad(mpos, (0, markers - k)), pad(mmask, (0, markers - k))
    if rows != n and one_token_rows:
        extra = rows - n
        att = torch.cat((att, pad(att.new_ones(extra, 1), (0, tokens - 1))))
        ids = torch.cat((ids, ids.new_full((extra, tokens), pad_id)))
        mpos = torch.cat((mpos, mpos.new_zeros(extra, markers)))
        mmask = torch.cat((mmask, mmask.new_zeros(extra, markers)))
        qtype = torch.cat((qtype, qtype.new_zeros(extra)))
    elif rows != n:
        last = [n - 1] * (rows - n)
        ids, att, mpos, mmask, qtype = (torch.cat((x, x[last])) for x in (ids, att, mpos, mmask, qtype))
    return ids, att, mpos, mmask, qtype


def for_runner(piece: Batch, runner: Any, ranges: Ranges, pad_id: int) -> Batch:
    """`piece` (already `pad_batch`ed) as `runner` is called with it: padded to the stepped shape its CUDA graphs
    replay (`GraphedCalls.shape_for`); unchanged for a runner without graphs or a call too large for one. The
    caller keeps the outputs of the piece's own rows (the first ones). The runtime and verification both call
    it, so that a verified figure covers what a service's graphed calls compute."""
    graphs = getattr(runner, "graphs", None)
    if graphs is None:
        return piece
    n, t, k = piece[0].shape[0], piece[0].shape[1], piece[2].shape[1]
    shape = graphs.shape_for(n, t, k, ranges)
    if shape is None or shape == (n, t, k):
        return piece
    return pad_call(piece, shape, pad_id, one_token_rows=getattr(runner, "packed", False))


def batch_of_shape(rows: int, tokens: int, markers: int) -> Batch:
    """`rows` rows of `tokens` tokens and `markers` markers (two of them real) whose values only have to run: token
    id 5 everywhere. What a start warms an artifact with, where only the shape decides what loads lazily."""
    import torch

    k = markers - 2
    return (torch.full((rows, tokens), 5, dtype=torch.long), torch.ones((rows, tokens), dtype=torch.long),
            torch.tensor([[1, 2] + [0] * k] * rows), torch.tensor([[True, True] + [False] * k] * rows),
            torch.zeros((rows,), dtype=torch.long))


def smallest_batch(ranges: Ranges) -> Batch:
    """One row at the smallest shape an artifact takes (its minimum tokens and markers, two of them real): what a
    probe child and the loader's warm-up call it with. Values do not matter there, only that it runs."""
    return batch_of_shape(1, ranges.min_tokens, ranges.min_markers)


def chunks(n_rows: int, ranges: Ranges, row_tokens: int = 0, budget: int = CHUNK_TOKENS):
    """Row slices of at most `max_rows` each (a request wider than the export runs in pieces) and, for rows of
    `row_tokens` padded tokens, at most `budget` tokens each; the rows are spread evenly over the pieces."""
    per = ranges.max_rows
    if budget > 0 and row_tokens > 0:
        per = max(1, min(per, budget // row_tokens))
    count = -(-n_rows // per)
    step = -(-n_rows // count) if count else per
    for start in range(0, n_rows, step):
        yield slice(start, min(n_rows, start + step))


def option_probs(logits: torch.Tensor, n_markers: int) -> torch.Tensor:
    """Option probabilities over the request's own markers (padded columns dropped)."""
    import torch

    return torch.softmax(logits[:, :n_markers].float(), -1)


def action_probs(act_logits: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.softmax(act_logits.float(), -1)


def near_tie_rows(logits: torch.Tensor, marker_mask: torch.Tensor, margin: float) -> torch.Tensor:
    """Indices of rows with two or more options whose top two option probabilities are within `margin`."""
    import torch

    k = logits.shape[1]
    if k < 2:
        return torch.empty(0, dtype=torch.long, device=logits.device)
    mask = marker_mask[:, :k].to(logits.device)
    top2 = option_probs(logits, k).topk(2, dim=-1).values
    return torch.nonzero((mask.sum(-1) >= 2) & (top2[:, 0] - top2[:, 1] <= margin)).flatten()
