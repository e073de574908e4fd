"""Deterministic demo checkpoints: real Laya checkpoint directories made offline from a seed.

No network exists where laya-aot is built and tested, so nothing may download weights. This module
writes the exact layout `laya.load(dir)` reads (`rl_agent_config.json`, `model.safetensors`,
`tokenizer/`, `encoder/`) for a ModernBERT config of any size, with weights drawn from a seeded
generator and scaled so that answers differ across options and inputs (a model that answers
uniformly would make every numerical comparison pass trivially).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Dict, Optional

import torch

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
    amp_dtype: str = "bf16"
    tokenizer_vocab: int = 1200
    # weight scales: large enough that options and inputs get clearly different answers; deep presets use
    # a smaller layer gain so that 22-28 random layers stay as well conditioned in bf16 as trained ones,
    # and head gain 1: with 2.0 the large-1024 model's own bf16 forward (any bf16 implementation, laya's
    # included) differed from fp32 by 0.030 in action probability on the CPU, over the 2e-2 tolerance;
    # with 1.0 it differs by 0.007 and answers still spread (benchmarks/investigations/bf16_scale_check.py)
    embed_std: float = 0.5
    layer_gain: float = 1.0
    head_gain: float = 3.0


PRESETS: Dict[str, DemoShape] = {
    # the default of every command and the tests' fixture: seconds to build on 2 cores
    "tiny": DemoShape(),
    # differs from tiny everywhere it can: hidden 96 with 3 heads (head dim 32, not 64),
    # one decision-head layer, four actions, context 384
    "tiny-alt": DemoShape(hidden_size=96, num_hidden_layers=2, num_attention_heads=3, intermediate_size=160,
                          vocab_size=1536, max_len=384, head_layers=1, n_actions=4, local_attention=32,
                          global_attn_every_n_layers=2, tokenizer_vocab=1000),
    "base-512": DemoShape(layer_gain=0.25, head_gain=1.0,
                          hidden_size=768, num_hidden_layers=22, num_attention_heads=12, intermediate_size=1152,
                          vocab_size=50368, max_len=512, local_attention=128, tokenizer_vocab=4000),
    "base-1024": DemoShape(layer_gain=0.25, head_gain=1.0,
                          hidden_size=768, num_hidden_layers=22, num_attention_heads=12, intermediate_size=1152,
                           vocab_size=50368, max_len=1024, local_attention=128, tokenizer_vocab=4000),
    "large-512": DemoShape(layer_gain=0.25, head_gain=1.0,
                          hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, intermediate_size=2624,
                           vocab_size=50368, max_len=512, local_attention=128, tokenizer_vocab=4000),
    "large-1024": DemoShape(layer_gain=0.25, head_gain=1.0,
                          hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, intermediate_size=2624,
                            vocab_size=50368, max_len=1024, local_attention=128, tokenizer_vocab=4000),
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


def _train_tokenizer(vocab: int):
    """A byte-level BPE tokenizer trained on the fixed corpus: any text encodes, nothing downloads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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


def make_checkpoint(out_dir: str | os.PathLike, shape: str | DemoShape = "tiny", seed: int = 0,
                    overwrite: bool = False) -> Path:
    """Write a Laya checkpoint directory for `shape` (a preset name or a DemoShape) and return its path.

    The directory is assembled beside its destination and renamed into place, so a killed run never
    leaves a half-written checkpoint that `laya.load` would accept.
    """
    from laya.common import build_model
    from safetensors.torch import save_file

    spec = PRESETS[shape] if isinstance(shape, str) else shape
    out = Path(out_dir)
    if out.exists():
        made = _demo_facts(out)
        if not overwrite and (out / "model.safetensors").exists():
            if made == {"seed": seed, "shape": asdict(spec)}:
                return out
            if made is None:
                raise FileExistsError("%s holds a checkpoint that make_checkpoint did not write; choose another "
                                      "directory or pass overwrite=True (--overwrite)" % out)
            log.warning("demo checkpoint %s was written for another shape or seed (an older preset?); "
                        "writing it again", out)
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".%s.partial-" % out.name, dir=out.parent))
    try:
        tok = _train_tokenizer(spec.tokenizer_vocab)
        tok.save_pretrained(str(tmp / "tokenizer"))
        _pin_tokenizer_class(tmp / "tokenizer" / "tokenizer_config.json")
        ecfg = _encoder_config(spec, tok)
        ecfg.save_pretrained(str(tmp / "encoder"))
        cfg = {
            "encoder": "answerdotai/ModernBERT-base",
            "head_layers": spec.head_layers,
            "act_costs": {"act_%d" % i: 0.1 * (i + 1) for i in range(spec.n_actions - 1)},
            "max_len": spec.max_len,
            "head_max_len": min(192, spec.max_len // 2),
            "amp_dtype": spec.amp_dtype,
            "temperature": [1.0, 1.0, 1.0],
            "laya_aot_demo": {"seed": seed, "shape": asdict(spec)},
        }
        model = build_model(cfg, encoder_dir=str(tmp / "encoder"), pretrained=False)
        save_file(_fill_weights(model, seed, spec), str(tmp / "model.safetensors"))
        with open(tmp / "rl_agent_config.json", "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote demo checkpoint %s (%s, seed %d)", out, shape if isinstance(shape, str) else "custom", seed)
    return out


def _demo_facts(ckpt: Path) -> Optional[Dict[str, object]]:
    """The seed and shape a demo checkpoint was written with (None: not one of ours, or unreadable)."""
    try:
        with open(ckpt / "rl_agent_config.json", encoding="utf-8") as f:
            return json.load(f).get("laya_aot_demo")
    except (OSError, ValueError):
        return None


def demo_shape(name: str, **overrides) -> DemoShape:
    """A preset with some fields changed (for example `demo_shape('tiny', max_len=128)`)."""
    if name not in PRESETS:
        raise ValueError("unknown demo shape %r; choose one of %s" % (name, ", ".join(PRESETS)))
    return replace(PRESETS[name], **overrides)


def main(argv: Optional[list] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="laya-aot make-demo", description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--shape", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    print(make_checkpoint(a.out_dir, a.shape, a.seed, overwrite=a.overwrite))
    return 0


__all__ = ["DemoShape", "PRESETS", "demo_shape", "make_checkpoint"]
