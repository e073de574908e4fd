"""Deterministic demo checkpoints: real Laya checkpoint directories made offline from a seed.

No network exists where laya-aot is built and tested, so nothing may download weights. This module
builds laya's DecisionModel for a ModernBERT config of any size, fills it with weights drawn from a
seeded generator (scaled so that answers differ across options and inputs: a model that answers
uniformly would make every numerical comparison pass trivially), trains it when its shape asks (the
`tiny-trained` preset `laya-aot demo` uses: synthetic support tickets, `demo/training.py`, so its answers
mean something), and writes it with laya's own
`laya.train.save_checkpoint`: fp16 weights on disk and the config keys laya's trainer writes, as a
user's fine-tuned checkpoint has them. `amp_dtype` is written only when a shape sets it; absent, laya
serves the checkpoint in fp16 on CUDA, as it does a fine-tune of a base checkpoint that had none.
"""
from __future__ import annotations

import json
import logging
import os
import stat
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from ..checkpoint import WEIGHTS_FILE, CheckpointError, read_config
from ..checkpoint import resolve as resolve_checkpoint
from ..files import cached_sha256, make_readable, sha256_file

log = logging.getLogger(__name__)

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")



@dataclass(frozen=True)
class DemoShape:
    """Dimensions of a demo checkpoint; the presets below name the ones the project uses."""

    hidden_size: int = 64
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    intermediate_size: int = 96
    vocab_size: int = 2048
    max_len: int = 256
    head_layers: int = 2
    n_actions: int = 3
    local_attention: int = 64
    global_attn_every_n_layers: int = 3
    # rl_agent_config.json's amp_dtype; None leaves it out (laya then serves fp16 on CUDA)
    amp_dtype: Optional[str] = None
    tokenizer_vocab: int = 1200
    # "bpe" (byte-level, as ModernBERT's) or "wordpiece" (as BERT's)
    tokenizer: str = "bpe"
    # False leaves the tokenizer config as transformers writes it, which laya.load rewrites in place on
    # first load (as it does for a checkpoint straight from laya's trainer)
    pin_tokenizer: bool = True
    # weight scales: large enough that options and inputs get clearly different answers; deep presets use
    # a smaller layer gain so that 22-28 random layers stay as well conditioned as trained ones. They are
    # not chosen to make any dtype pass verification: a 16-bit artifact is judged against laya's own
    # forward in that dtype (laya_aot/numerics/tolerance.py), however decisive the checkpoint's answers are
    embed_std: float = 0.5
    layer_gain: float = 1.0
    head_gain: float = 3.0
    # synthetic support tickets the model is trained on when it is made (laya_aot/demo/training.py), from the
    # seeded weights above, for `train_epochs`; 0 keeps those weights as drawn
    train_tickets: int = 0
    train_epochs: int = 3


# ModernBERT-base's dimensions (and -large's below), a context apart in the presets
_BASE = dict(layer_gain=0.25, head_gain=2.0, hidden_size=768, num_hidden_layers=22, num_attention_heads=12,
             intermediate_size=1152, vocab_size=50368, local_attention=128, tokenizer_vocab=4000, amp_dtype="bf16")
_LARGE = dict(_BASE, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, intermediate_size=2624)

PRESETS: Dict[str, DemoShape] = {
    # the default of every command and the tests' fixture: seconds to build on 2 cores; no amp_dtype
    "tiny": DemoShape(),
    # `laya-aot demo`'s checkpoint (checkpoint=demo): tiny, trained for about a minute on synthetic tickets so
    # that it routes billing, technical and account questions as a person would. Trained from a small start
    # (embeddings at the usual 0.02, the head's gain 1) for 4 epochs of 900 tickets: each of seeds 0-5 then routes
    # the demo's three states right at a probability of 0.99 or more, where the untrained presets' scales and 3
    # epochs of 600 got 3 of the 6 right (and seed 0's answers depended on the CPU's vector instructions)
    "tiny-trained": DemoShape(embed_std=0.02, head_gain=1.0, train_tickets=900, train_epochs=4),
    # differs from tiny everywhere it can: hidden 96 with 3 heads (head dim 32, not 16), one decision-head
    # layer, four actions, context 384, amp_dtype fp16 written out
    "tiny-alt": DemoShape(hidden_size=96, num_hidden_layers=2, num_attention_heads=3, intermediate_size=160,
                          vocab_size=1536, max_len=384, head_layers=1, n_actions=4, local_attention=32,
                          global_attn_every_n_layers=2, tokenizer_vocab=1000, amp_dtype="fp16"),
    # ModernBERT-base and -large dimensions with amp_dtype bf16, as laya's shipped checkpoints
    "base-512": DemoShape(max_len=512, **_BASE),
    "base-1024": DemoShape(max_len=1024, **_BASE),
    "large-512": DemoShape(max_len=512, **_LARGE),
    "large-1024": DemoShape(max_len=1024, **_LARGE),
}

# the preset of checkpoint=demo (configs/checkpoint/demo.yaml), which `laya-aot demo` builds and loads
DEMO_SHAPE = "tiny-trained"

# Checkpoints the defaults were never tuned on, spread over what users have: amp_dtype bf16 / fp16 /
# absent, head dims 16-64, 1-16 encoder heads, 1-3 decision-head layers, 2-8 actions, contexts 128-2048,
# several local-attention windows, BPE and WordPiece, decisive answers (large head weights), a tokenizer
# config as laya's trainer leaves it. tests/pipeline/test_matrix.py runs each on the CPU; benchmarks/gpu_matrix.py
# on a GPU.
_SMALL = dict(tokenizer_vocab=900)
MATRIX: Dict[str, DemoShape] = {
    # head dim 32, one head layer, four actions, context 256, decisive, no amp_dtype
    "hd32-absent-decisive": DemoShape(hidden_size=96, num_attention_heads=3, num_hidden_layers=2,
                                      intermediate_size=128, head_layers=1, n_actions=4, max_len=256,
                                      local_attention=32, head_gain=8.0, tokenizer="wordpiece",
                                      pin_tokenizer=False, **_SMALL),
    "hd16-1head-ctx128": DemoShape(hidden_size=16, num_attention_heads=1, num_hidden_layers=1, intermediate_size=32,
                                   head_layers=1, n_actions=2, max_len=128, local_attention=16, **_SMALL),
    "hd16-16heads-fp16": DemoShape(hidden_size=256, num_attention_heads=16, num_hidden_layers=2,
                                   intermediate_size=384, head_layers=2, n_actions=5, max_len=512, local_attention=64,
                                   head_gain=6.0, amp_dtype="fp16", tokenizer="wordpiece", **_SMALL),
    "hd64-bf16-ctx1024": DemoShape(hidden_size=256, num_attention_heads=4, num_hidden_layers=2, intermediate_size=320,
                                   head_layers=3, n_actions=3, max_len=1024, local_attention=256, amp_dtype="bf16",
                                   **_SMALL),
    "hd32-8actions-ctx2048": DemoShape(hidden_size=64, num_attention_heads=2, num_hidden_layers=3,
                                       intermediate_size=96, global_attn_every_n_layers=2, head_layers=3, n_actions=8,
                                       max_len=2048, local_attention=128, amp_dtype="bf16", tokenizer="wordpiece",
                                       head_gain=5.0, **_SMALL),
    "hd16-8heads-fp16-ctx384": DemoShape(hidden_size=128, num_attention_heads=8, num_hidden_layers=2,
                                         intermediate_size=192, head_layers=2, n_actions=6, max_len=384,
                                         local_attention=48, amp_dtype="fp16", **_SMALL),
}

# A small fixed corpus for the tokenizer: deterministic, offline, and close enough to the
# questions and states Laya sees that words tokenize into a few pieces rather than bytes.
_CORPUS = """
choice question: which team should handle this ticket? billing: payments, invoices, refunds
technical: errors, crashes, bugs, outages account: login, password, profile, settings
score question: how urgent is this message? level 0: not urgent level 1: somewhat urgent
level 2: urgent level 3: critical, act now noul question: the customer is angry. false: no,
the statement does not hold true: yes, the statement holds. The user wrote an email saying
that the invoice for March was charged twice and asked for a refund of the second payment.
The service has been down since this morning and nobody in the office can log in. Please
reset my password, I forgot it after the holidays. The delivery arrived late and the box was
damaged; I want to return the product and get my money back. Our deployment failed with a
timeout error in the database migration step. Thanks for the quick answer, everything works.
Is the statement about the weather true? It is raining in the city and the streets are wet.
The meeting is moved to Thursday at ten o'clock in the large conference room on the third floor.
Security alert: an unknown device signed in to the account from another country last night.
""".strip()


def _train_tokenizer(vocab: int, kind: str = "bpe"):
    """A tokenizer trained on the fixed corpus, nothing downloads: byte-level BPE (any text encodes) or
    WordPiece with BERT's pre-tokenizer (unknown words become [UNK])."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        tok.train_from_iterator([_CORPUS] * 4, trainer=trainers.WordPieceTrainer(
            vocab_size=vocab, special_tokens=list(SPECIALS), show_progress=False))
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                       cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                       model_max_length=1 << 20)
    if kind != "bpe":
        raise ValueError("unknown demo tokenizer %r; use bpe or wordpiece" % kind)

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                   model_max_length=1 << 20)


def _pin_tokenizer_class(path: Path) -> None:
    """Name the tokenizer class laya expects, so `laya.load` has nothing to rewrite in the checkpoint."""
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("backend", None)
    cfg.pop("is_local", None)
    path.write_text(json.dumps(cfg, indent=2), encoding="utf-8")


def _encoder_config(shape: DemoShape, tok):
    from transformers import ModernBertConfig

    return ModernBertConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads, intermediate_size=shape.intermediate_size,
        max_position_embeddings=max(8192, shape.max_len), local_attention=shape.local_attention,
        global_attn_every_n_layers=shape.global_attn_every_n_layers,
        pad_token_id=tok.pad_token_id, cls_token_id=tok.cls_token_id, sep_token_id=tok.sep_token_id,
        bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id)


def _fill_weights(model: torch.nn.Module, seed: int, spec: DemoShape) -> Dict[str, torch.Tensor]:
    """Seeded weights, drawn per tensor in name order so the result does not depend on module order.

    Norm weights are 1, most matrices N(0, 0.02)-like scaled by fan-in; the scorer and action head are
    scaled up so option logits spread over several units and answers are clearly not uniform.
    """
    state = {}
    for i, (name, ref) in enumerate(sorted(model.state_dict().items())):
        if name.endswith("temperature"):
            state[name] = torch.ones(ref.shape)
            continue
        g = torch.Generator().manual_seed(seed * 100_003 + i)
        is_norm = "norm" in name.split(".")[-2].lower() if "." in name else False
        if is_norm or (name.startswith("scorer.0.")):
            t = (torch.ones(ref.shape) if name.endswith("weight") else torch.zeros(ref.shape))
        elif ref.dim() <= 1:
            t = torch.randn(ref.shape, generator=g) * 0.02
        else:
            fan_in = ref.shape[-1]
            gain = 1.0
            if name.startswith(("scorer.", "act_head.")):
                gain = spec.head_gain / spec.layer_gain
            if "embeddings" in name or name.startswith("type_emb"):
                t = torch.randn(ref.shape, generator=g) * spec.embed_std
            else:
                t = torch.randn(ref.shape, generator=g) * (gain * spec.layer_gain / fan_in ** 0.5)
        state[name] = t.to(torch.float32).contiguous()
    return state


# bumped when the files written for the same shape and seed change (2: fp16 weights, laya's own writer)
FORMAT = 2


def make_checkpoint(out_dir: str | os.PathLike, shape: str | DemoShape = "tiny", seed: int = 0,
                    overwrite: bool = False) -> Path:
    """Write a Laya checkpoint directory for `shape` (a preset or matrix name, or a DemoShape) and return
    its path.

    A directory holding this very checkpoint (shape, seed, format) is reused as it is. Otherwise the new one is
    assembled beside its destination and swapped into place through the staging transaction
    (`staging.staged`), so a killed run never leaves a half-written checkpoint that `laya.load` would accept:
    what was there stays until the new one is complete, and the next run removes the partial directory.
    Makers of one checkpoint at once (a multirun's jobs) keep the first published: the others discard theirs.
    """
    from laya.common import build_model
    from laya.train import save_checkpoint

    from ..staging import MARKER, OutputRefused, may_replace, staged

    spec = demo_shape(shape) if isinstance(shape, str) else shape
    facts = {"seed": seed, "shape": asdict(spec), "format": FORMAT}
    out = Path(out_dir)
    if not overwrite and _holds(out, facts):
        return out  # the same request: reused as it is
    try:
        may_replace(out, "make-demo", overwrite, ours=_not_a_demo_checkpoint, fix="--overwrite (overwrite=True)",
                    noun="demo checkpoint")
    except OutputRefused as e:
        raise FileExistsError(str(e)) from None
    if os.path.lexists(out):
        log.warning("replacing %s (another shape or seed, an older preset?, or --overwrite)", out)
    with staged(out, same=None if overwrite else lambda p: _holds(p, facts)) as tmp:
        tok = _train_tokenizer(spec.tokenizer_vocab, spec.tokenizer)
        _encoder_config(spec, tok).save_pretrained(str(tmp / "encoder"))
        # the keys laya's trainer writes for a fine-tune (laya.train), amp_dtype only when the shape sets it
        cfg = {
            "encoder": "answerdotai/ModernBERT-base",
            "head_layers": spec.head_layers,
            "act_costs": {"act_%d" % i: 0.1 * (i + 1) for i in range(spec.n_actions - 1)},
            "max_len": spec.max_len,
            "head_max_len": min(192, spec.max_len // 2),
            "fine_tuned": True,
            "temperature": [1.0, 1.0, 1.0],
            "temperature_by_options": {},
            "laya_aot_demo": facts,
        }
        if spec.amp_dtype is not None:
            cfg["amp_dtype"] = spec.amp_dtype
        model = build_model(cfg, encoder_dir=str(tmp / "encoder"), pretrained=False)
        model.load_state_dict(_fill_weights(model, seed, spec), strict=True)
        if spec.train_tickets:
            from .training import train

            log.info("training the demo model on %d synthetic tickets (about a minute on a small CPU)",
                     spec.train_tickets)
            train(model, tok, cfg, seed, n_tickets=spec.train_tickets, epochs=spec.train_epochs)
        save_checkpoint(model, tok, cfg, str(tmp))  # fp16 weights, encoder config, tokenizer, config
        if spec.pin_tokenizer:
            _pin_tokenizer_class(tmp / "tokenizer" / "tokenizer_config.json")
        _write_record(tmp, leave_out=MARKER)  # the staging's marker goes at publishing
        make_readable(tmp)  # another user (a service) must read it
    log.info("wrote demo checkpoint %s (%s, seed %d)", out, shape if isinstance(shape, str) else "custom", seed)
    return out


def _holds(ckpt: Path, facts: Dict[str, object]) -> bool:
    """Whether `ckpt` is the demo checkpoint of `facts` (seed, shape, format), written to the end and, where it
    holds the record of its files (every one since that record exists), unchanged since."""
    return _demo_facts(ckpt) == facts and (ckpt / WEIGHTS_FILE).is_file() and (
        not os.path.lexists(ckpt / RECORD) or _changed(ckpt) is None)


# every file make_checkpoint wrote, at its size and sha256: what proves a demo checkpoint unchanged (its weights
# included), so that make-demo never replaces one a user edited in place; not one of the files laya reads
RECORD = "laya_aot_demo_files.json"
_RECORD_MAX_BYTES = 1 << 20
_DEMO_LAYOUT = {WEIGHTS_FILE, "rl_agent_config.json", "encoder", "tokenizer", RECORD}


def _write_record(ckpt: Path, leave_out: str) -> None:
    files = {p.relative_to(ckpt).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(ckpt.rglob("*")) if p.is_file() and p.name not in (RECORD, leave_out)}
    (ckpt / RECORD).write_text(json.dumps({"files": files}, indent=1), encoding="utf-8")


def _changed(ckpt: Path) -> Optional[str]:
    """Why `ckpt`'s files are not the ones its record lists (None: every file is, at its size and sha256)."""
    path = ckpt / RECORD
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _RECORD_MAX_BYTES:
            return "its %s is not the record make-demo writes" % RECORD
        files = json.loads(path.read_bytes())["files"]
        wanted = {str(k): (int(v["size"]), str(v["sha256"])) for k, v in files.items()}
    except FileNotFoundError:
        return "it has no %s, the record of the files make-demo wrote (an older laya-aot's, or removed)" % RECORD
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "its %s is not the record make-demo writes" % RECORD
    present = {p.relative_to(ckpt).as_posix(): p for p in ckpt.rglob("*") if p.is_file() and p != path}
    for rel in sorted(set(wanted) | set(present)):
        if rel not in present:
            return "%s is missing" % rel
        if rel not in wanted:
            return "it holds %s, which make-demo did not write" % rel
        size, digest = wanted[rel]
        if present[rel].stat().st_size != size or cached_sha256(present[rel], digest) != digest:
            return "%s changed since make-demo wrote it" % rel
    return None


def _not_a_demo_checkpoint(ckpt: Path) -> Optional[str]:
    """Why `ckpt` is not a demo checkpoint make_checkpoint wrote (None: it is, and nothing else is inside):
    the facts it records in rl_agent_config.json, only the entries it writes, regular files in two
    directories at most, no link, and every file as its record lists it (the weights included)."""
    if _demo_facts(ckpt) is None:
        return "its rl_agent_config.json has no laya_aot_demo record"
    for p in ckpt.iterdir():
        if p.name not in _DEMO_LAYOUT:
            return "it holds %s, which make-demo does not write" % p.name
        if p.is_symlink():
            return "%s is a symbolic link" % p.name
        for q in (p.iterdir() if p.is_dir() else ()):
            if q.is_symlink() or not q.is_file():
                return "%s/%s is not a file make-demo writes" % (p.name, q.name)
    return _changed(ckpt)


def _demo_facts(ckpt: Path) -> Optional[Dict[str, object]]:
    """The seed and shape a demo checkpoint was written with (None: not one of ours, or unreadable)."""
    try:
        return read_config(ckpt).get("laya_aot_demo")
    except (OSError, ValueError, AttributeError):
        return None


def resolve(cfg: Any) -> Path:
    """The checkpoint directory a `CheckpointConfig` names (`checkpoint.resolve`), the demo checkpoint made
    under `demo_dir` when it names neither a path nor a hub id but a demo shape."""
    if cfg.demo_shape and not cfg.path and not cfg.hub_id:
        shapes = {**PRESETS, **MATRIX}
        if cfg.demo_shape not in shapes:
            raise CheckpointError("checkpoint.demo_shape=%s is not a demo shape; choose one of %s, or name a "
                                  "checkpoint with checkpoint.path=DIR" % (cfg.demo_shape, ", ".join(shapes)))
        name = cfg.name or "demo"
        out = Path(cfg.demo_dir) / ("%s-%s-seed%d" % (name, cfg.demo_shape, cfg.demo_seed))
        return make_checkpoint(out, cfg.demo_shape, cfg.demo_seed)
    return resolve_checkpoint(cfg)


def demo_shape(name: str, **overrides) -> DemoShape:
    """A preset or matrix shape with some fields changed (for example `demo_shape('tiny', max_len=128)`)."""
    shapes = {**PRESETS, **MATRIX}
    if name not in shapes:
        raise ValueError("unknown demo shape %r; choose one of %s" % (name, ", ".join(shapes)))
    return replace(shapes[name], **overrides)


WORDS = ("invoice refund payment charged twice password login server down error crash deploy timeout "
         "meeting moved thursday angry thanks urgent critical delivery late damaged box security alert").split()


def state_text(rng, n_words: int) -> str:
    """`n_words` words of support-ticket vocabulary drawn with the numpy generator `rng`."""
    return " ".join(rng.choice(WORDS, n_words))


def question_suite() -> Dict[str, Dict[str, object]]:
    """60 typed questions for comparing answers: choices (one criterion up to six), score rubrics (2-6
    levels), noul with and without text."""
    import numpy as np

    rng = np.random.default_rng(5)
    qs = {}
    for i in range(20):
        n = 1 + i % 6
        qs["choice_%d" % i] = {"type": "choice", "instructions": "Which option fits? %s" % state_text(rng, 3),
                               "criteria": {"opt%d" % j: state_text(rng, 2) for j in range(n)}}
    for i in range(20):
        qs["score_%d" % i] = {"type": "score", "instructions": "Rate it: %s" % state_text(rng, 4),
                              "criteria": [state_text(rng, 2) for _ in range(2 + i % 5)]}
    for i in range(20):
        q = {"type": "noul", "instructions": "Is this true? %s" % state_text(rng, 5)}
        if i % 2:
            q["criteria"] = {"true": state_text(rng, 2), "false": state_text(rng, 2)}
        qs["noul_%d" % i] = q
    return qs


def main(argv: Optional[list] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="laya-aot make-demo", description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="the checkpoint directory to write (reused when it holds the same shape and seed)")
    p.add_argument("--shape", default="tiny", choices=sorted({**PRESETS, **MATRIX}), metavar="SHAPE",
                   help="a preset (%s) or a matrix shape; %s is laya-aot demo's (default: %%(default)s)"
                   % (", ".join(PRESETS), DEMO_SHAPE))
    p.add_argument("--seed", type=int, default=0, help="the seed of the weights and of the training data "
                   "(default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace a directory make-demo did not write")
    a = p.parse_args(argv)
    print(make_checkpoint(a.out_dir, a.shape, a.seed, overwrite=a.overwrite))
    return 0


__all__ = ["DEMO_SHAPE", "MATRIX", "DemoShape", "PRESETS", "demo_shape", "make_checkpoint", "question_suite",
           "state_text"]
