"""`laya-aot build --help`: the config groups and every key, in laya-aot's words (Hydra's own help names
its internals; `laya-aot build --hydra-help` still shows it). tests/cli/test_cli.py checks that every key of
the schema (`config.py`) is described here."""
from __future__ import annotations

from typing import List

_TEXT = """\
usage: laya-aot build [--quiet] [KEY=VALUE ...] [GROUP=OPTION ...] [-m] [--config-dir DIR] [--cfg job]

Turn a Laya checkpoint into a verified bundle: every artifact is built, run on seeded cases and compared
with laya's eager forward; bundle.json is written last. Defaults: the demo checkpoint, target cpu, the
bundle in artifacts/<checkpoint name>.

  laya-aot build checkpoint.path=/models/my-laya            a local checkpoint, CPU artifacts
  laya-aot build checkpoint=laya-typed-decisions target=sm_90 export.max_rows=128

Config groups (GROUP=OPTION picks a whole set of values):
  checkpoint   which checkpoint: {checkpoints}
  target       which machine the bundle is for: {targets}

Keys (KEY=VALUE overrides one value):
  checkpoint.path         a local Laya checkpoint directory (wins over the rest of the group)
  checkpoint.hub_id, checkpoint.subfolder
                          a shipped checkpoint already in the local Hugging Face cache (nothing downloads)
  checkpoint.name         the bundle's name (default: read from the checkpoint)
  checkpoint.max_len      the context length (default: the checkpoint's)
  checkpoint.demo_shape, checkpoint.demo_seed, checkpoint.demo_dir
                          the built-in demo checkpoint: its preset, seed, and where it is made
  target.name, target.device, target.arch
                          the target's name, cpu or cuda, and the CUDA architecture (sm_90)
  target.tilelang_archs   TileLang architectures to cross-compile kernels for (no GPU needed)
  target.dtypes           dtypes to build, e.g. [fp16,bf16] (default: the one laya serves in on the target)
  export.max_rows, export.max_markers, export.max_tokens
                          the largest batch an artifact accepts: rows, options per question, tokens
  export.action_head_dtype
                          the dtype of the action head (default fp32)
  export.precision        how a 16-bit artifact computes: faithful (default: fp32 but for the matrix products,
                          which take 16-bit inputs with fp32 accumulation, fp16 where the checkpoint's measured
                          activations leave room, else bf16) or laya (autocast in the target dtype, as laya serves)
  export.fp16_headroom    the faithful path takes fp16 only where the largest activation times this (default 16)
                          stays below fp16's 65504
  export.attention        triton (default: one Triton attention kernel on a GPU in 16 bits) or stock
  export.rotary           table (default: the rotary cos/sin read from a table made at export) or computed
                          (recomputed in every layer, as transformers does)
  export.head             answer_rows (default: the decision head's last layer computed only at position 0 and
                          the markers, the rows laya reads; every head layer's attention projected batch-first)
                          or full (laya's head as it is, every token)
  export.rows             padded (default: every row at the width of the call's longest) or packed (GPU targets:
                          the encoder runs the call's rows back to back, their own tokens only; slower on an H100)
  export.example_rows, export.example_tokens
                          the example batch the export is traced at and AOTInductor tunes its kernels at
                          (default: 8 x 1024 on a GPU, capped by max_rows and max_tokens; 3 x 48 on the CPU)
  export.ship_program     also write the portable torch.export program into the bundle, verified (default false:
                          it holds a copy of every weight and no runtime reads it)
  aoti.cxx                the C++ compiler for AOTInductor (default: the first that links libstdc++ dynamically)
  aoti.cpu_frozen         also build a CPU package with the weights frozen inside (default false: faster only
                          on larger models, and the size of the weights)
  stages.aoti, stages.onnx, stages.tilelang, stages.inductor_cache
                          turn an artifact kind off (=false); export and verify always run
  verify.seed             the seed of the verification cases
  verify.tolerance.fp32, verify.tolerance.bf16, verify.tolerance.fp16, verify.tolerance.argmax_fp32,
  verify.tolerance.relative, verify.tolerance.argmax_margin
                          the verification rule (laya_aot/numerics/tolerance.py); stored in bundle.json
  verify.tolerance.decisions, verify.tolerance.decisions_alpha
                          a 16-bit artifact's decision suite: its size (default 2048) and the significance
                          level at which it fails for being less faithful to fp32 than laya eager (0.01)
  verify.tolerance.near_ties, verify.tolerance.near_tie_pool
                          the statement's near-tie part: up to this many rows whose fp32 top two options are
                          within the 16-bit error (default 512), found among at most this many seeded rows (8192)
  verify.latency_repeats  timed rounds of the artifacts' interleaved latency calls
  output_dir              where the bundle goes (default artifacts/<checkpoint name>)
  overwrite               replace output_dir even if laya-aot did not write it (default false)
  jobs                    parallel compile jobs (default: all cores)

Options:
  --quiet                 no live progress lines (they show only on a terminal anyway)
  -m                      a sweep, e.g. -m target=cpu,sm_90: one partial bundle per job under artifacts/parts/
  --config-dir DIR        your own config groups (DIR/checkpoint/NAME.yaml, DIR/target/NAME.yaml)
  --cfg job               print the resolved config and stop
  --hydra-help            Hydra's own help (launchers, sweepers)
"""


def text() -> str:
    from .usage import group_options

    def listed(group: str) -> str:
        return ", ".join(o for o in group_options(group, []) if not o.startswith("base_"))

    return _TEXT.format(checkpoints=listed("checkpoint"), targets=listed("target"))


def described_keys() -> List[str]:
    """The keys this help names (for the test that keeps it complete)."""
    import re

    return re.findall(r"\b(?:checkpoint|target|export|aoti|stages|verify)\.[a-z_0-9]+(?:\.[a-z_0-9]+)?|\boutput_dir\b|"
                      r"\bjobs\b|\boverwrite\b", _TEXT)
