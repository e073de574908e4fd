"""Mistakes on the command line, caught before anything heavy loads, each as one line naming the fix.

torch, laya and transformers take seconds to import; a typo should not. `cli/__init__.py` asks `mistake` before it
dispatches: a build override naming no key of the schema (`export.max_row=32`: did you mean
`export.max_rows`?) or no option of a config group (`target=sm90`: did you mean `sm_90`?), a value of the
wrong type, a file where a directory is expected (`inspect .../bundle.json`, `checkpoint.path=<a file>`), a
`checkpoint.path` that is not a Laya checkpoint (`checkpoint.check_layout`), a `--config-dir` that is not a
directory, the same mistakes inside the YAML files of a `--config-dir` the build would use, and swapped
`pack`/`unpack` arguments. What it does not recognise it leaves to the command itself.
Only the standard library, PyYAML, `checkpoint.py` (no torch) and the schema (`config.py`, which loads omegaconf
and hydra's config store, not torch) are imported here.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

from ..distribution import PACK_SUFFIX

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
GROUPS = ("checkpoint", "target")
DEFAULTS = {"checkpoint": "demo", "target": "cpu"}  # configs/build.yaml's defaults list
# the Hydra flags that take a value (the value is not an override)
_HYDRA_VALUE_FLAGS = {"--config-dir", "-cd", "--config-name", "-cn", "--config-path", "-cp", "--cfg", "-c",
                      "--package", "-p", "--info", "-i", "--experimental-rerun"}
# the value flags of the other commands (their values are not positional arguments)
_VALUE_FLAGS = {"--device", "--checkpoint", "--seed", "--bundle", "--out", "--shape"}
_OVERRIDE = re.compile(r"^(\+\+|\+|~)?([A-Za-z_][\w./@-]*)=(.*)$", re.S)
_TRUE_FALSE = {"true", "false", "yes", "no", "on", "off", "1", "0"}
# what each command needs on its command line: (positional arguments, what they are, an example)
NEEDS = {
    "inspect": (1, "a bundle directory", "laya-aot inspect artifacts/demo"),
    "bench": (1, "a bundle directory", "laya-aot bench artifacts/demo"),
    "verify": (1, "a bundle directory and --checkpoint DIR",
               "laya-aot verify artifacts/demo --checkpoint artifacts/checkpoints/demo-tiny-trained-seed0"),
    "pack": (2, "a bundle directory and the pack to write", "laya-aot pack artifacts/demo demo.tar.zst"),
    "unpack": (2, "a pack and the bundle directory to create", "laya-aot unpack demo.tar.zst artifacts/demo"),
    "merge": (2, "the merged bundle's directory and the partial bundles",
              "laya-aot merge artifacts/demo artifacts/parts/demo/*"),
    "fetch": (1, "what to fetch (hf://ORG/REPO, a pack, a directory of packs)", "laya-aot fetch demo.tar.zst"),
    "make-demo": (1, "the directory to write the checkpoint to", "laya-aot make-demo checkpoints/demo"),
}


def mistake(cmd: str, argv: List[str]) -> Optional[str]:
    """One line naming the mistake in `laya-aot CMD ARGV` and its fix, or None when none is seen."""
    if cmd == "build":
        return build_mistake(argv)
    args = _positionals(argv)
    if cmd in NEEDS:
        n, what, example = NEEDS[cmd]
        if len(args) < n or (cmd == "verify" and _value_of(argv, "--checkpoint") is None):
            return "needs %s, e.g. `%s` (laya-aot %s --help lists its options)" % (what, example, cmd)
    if cmd in ("inspect", "bench", "verify") and args:
        why = _not_a_bundle_dir(cmd, Path(args[0]))
        if why:
            return why
    if cmd in ("verify", "bench"):
        ckpt = _value_of(argv, "--checkpoint")
        if ckpt and Path(ckpt).is_file():
            return "--checkpoint %s is a file; pass the checkpoint directory%s" % (ckpt, _parent_hint(Path(ckpt)))
    if cmd == "pack" and len(args) == 2:
        src, dst = Path(args[0]), Path(args[1])
        if src.is_file():
            swap = " (did you mean `laya-aot pack %s %s`?)" % (args[1], args[0]) if dst.is_dir() or \
                src.name.endswith(PACK_SUFFIX) else ""
            return "%s is a file; the arguments are BUNDLE (a bundle directory) then FILE (the pack to write)%s" % (
                args[0], swap)
    if cmd == "unpack" and len(args) == 2:
        src, dst = Path(args[0]), Path(args[1])
        if src.is_dir():
            swap = " (did you mean `laya-aot unpack %s %s`?)" % (args[1], args[0]) if dst.is_file() else ""
            return "%s is a directory; the arguments are FILE (a pack, *.tar.zst) then DIR (the bundle to create)%s" % (
                args[0], swap)
    if cmd == "merge" and args and Path(args[0]).is_file():
        return "%s is a file; the first argument is OUT, the merged bundle's directory (absent, empty, or a bundle)" % (
            args[0])
    return None


def _not_a_bundle_dir(cmd: str, p: Path) -> Optional[str]:
    if not p.is_file():
        return None
    if p.name == "bundle.json":
        return "%s is the bundle's manifest; pass the bundle directory: laya-aot %s %s" % (p, cmd, p.parent)
    if p.name.endswith(PACK_SUFFIX):
        return "%s is a pack; unpack it first (laya-aot unpack %s DIR, or laya-aot fetch %s) and pass DIR" % (p, p, p)
    return "%s is a file; pass a bundle directory (the one holding bundle.json)" % p


def _parent_hint(p: Path) -> str:
    """`: did you mean DIR?` when the file sits in a Laya checkpoint directory."""
    for d in (p.parent, p.parent.parent):
        if (d / "rl_agent_config.json").is_file():
            return " (did you mean %s?)" % d
    return " (the one holding rl_agent_config.json, model.safetensors, tokenizer/ and encoder/)"


def _positionals(argv: List[str]) -> List[str]:
    return [a for _, a in _words(argv, _VALUE_FLAGS)]


def _words(argv: List[str], value_flags: Set[str]) -> Iterator[Tuple[int, str]]:
    """(index, word) of each argument that is neither a flag nor the value of one of `value_flags`."""
    skip = False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a.startswith("-"):
            skip = a in value_flags
        else:
            yield i, a


def _value_of(argv: List[str], flag: str) -> Optional[str]:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


# ------------------------------------------------------------------------------------------ build

def schema_keys() -> Dict[str, Any]:
    """Every dotted key of the build config (`export.max_rows`, `verify.tolerance.fp32`) and its type."""
    from ..config import BuildConfig

    out: Dict[str, Any] = {}

    def walk(cls: Any, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            t = hints[f.name]
            if dataclasses.is_dataclass(t):
                walk(t, prefix + f.name + ".")
            else:
                out[prefix + f.name] = t

    walk(BuildConfig, "")
    return out


def group_options(group: str, config_dirs: List[str]) -> List[str]:
    """The options of a config group: the packaged YAML files and those of each `--config-dir`."""
    names = set()
    for root in [CONFIGS, *map(Path, config_dirs)]:
        names.update(p.stem for p in (root / group).glob("*.yaml"))
    return sorted(names)


def _overrides(argv: List[str]) -> Iterator[Tuple[str, str, str]]:
    """(prefix, key, value) of each override; flags and their values are skipped."""
    for _, prefix, key, value in _placed_overrides(argv):
        yield prefix, key, value


def _placed_overrides(argv: List[str]) -> Iterator[Tuple[int, str, str, str]]:
    """(index in argv, prefix, key, value) of each override."""
    for i, a in _hydra_words(argv):
        m = _OVERRIDE.match(a)
        if m:
            yield i, m.group(1) or "", m.group(2), m.group(3)


def _hydra_words(argv: List[str]) -> Iterator[Tuple[int, str]]:
    """(index, word) of each `laya-aot build` argument that is neither a flag nor a flag's value: Hydra's
    overrides."""
    return _words(argv, _HYDRA_VALUE_FLAGS)


def _config_dirs(argv: List[str]) -> List[str]:
    dirs = []
    for i, a in enumerate(argv):
        if a in ("--config-dir", "-cd") and i + 1 < len(argv):
            dirs.append(argv[i + 1])
        elif a.startswith("--config-dir="):
            dirs.append(a.split("=", 1)[1])
    return dirs


def _nearest(word: str, choices: List[str]) -> Optional[str]:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return close[0] if close else None


def build_mistake(argv: List[str]) -> Optional[str]:
    """The first override of `laya-aot build ARGV` that names no key, no group option, or a value of the wrong
    type or kind, as one line with the nearest valid one; then the same of the `--config-dir` files it selects."""
    keys = schema_keys()
    dirs = _config_dirs(argv)
    for d in dirs:
        if not Path(d).expanduser().is_dir():
            return "--config-dir %s %s; name the directory holding your config groups (checkpoint/NAME.yaml, " \
                   "target/NAME.yaml)" % (d, "is a file" if Path(d).expanduser().exists() else "does not exist")
    why = _override_mistake(argv, keys, dirs)
    return why or _config_dir_mistake(argv, keys, dirs)


def _override_mistake(argv: List[str], keys: Dict[str, Any], dirs: List[str]) -> Optional[str]:
    sweep, builds_here = _sweep(argv), _builds_here(argv)
    # another search path or primary config may add group options this check cannot list: Hydra judges those
    other_configs = any(a.startswith(("hydra.searchpath", "+hydra.searchpath", "--config-path", "-cp"))
                        for a in argv)
    for _, word in _hydra_words(argv):
        if not _OVERRIDE.match(word) and not word.startswith("~"):  # `~key` deletes a key: no value
            near = _nearest(word, list(keys) + list(GROUPS))
            fix = ("give it a value: `%s=...`" % word if near == word else "did you mean `%s=...`?" % near if near
                   else "`laya-aot build --help` lists every key")
            return "`%s`: an override is KEY=VALUE; %s" % (word, fix)
    for prefix, key, value in _overrides(argv):
        if prefix or key.startswith("hydra") or "/" in key:  # `+new=`, `~key`, hydra's own and nested groups
            continue
        if key in GROUPS:
            if other_configs:
                continue
            options = group_options(key, dirs)
            if sweep and any(c in value for c in "()[]*"):  # a sweep function or glob: Hydra expands it
                continue
            for v in (value.split(",") if sweep else [value]):
                if v not in options:
                    near = _nearest(v, options)
                    return "`%s=%s`: no %s config named %s; %s(the %ss: %s)" % (
                        key, v, key, v, "did you mean `%s`? " % near if near else "", key, ", ".join(options))
            continue
        if key not in keys:
            near = _nearest(key, list(keys) + list(GROUPS))
            return "`%s=%s`: laya-aot build has no key %s; %s" % (
                key, value, key, "did you mean `%s`?" % near if near else "`laya-aot build --help` lists every key")
        why = _wrong_value(key, value, keys[key], sweep, builds_here)
        if why:
            return why
    return None


def _sweep(argv: List[str]) -> bool:
    return "-m" in argv or "--multirun" in argv


def _builds_here(argv: List[str]) -> bool:
    """Whether this command builds on this machine: a sweep's jobs may run on other machines (and one job that
    cannot build fails alone, after the others), and printing the config (--cfg, --info) builds nothing; neither
    needs checkpoint.path to be a checkpoint here."""
    return not _sweep(argv) and not any(a in ("--cfg", "-c", "--info", "-i") for a in argv)


def _config_dir_mistake(argv: List[str], keys: Dict[str, Any], dirs: List[str]) -> Optional[str]:
    """The first mistake inside a `--config-dir` YAML file of a group option this build selects, as one line naming
    the file: YAML that does not parse, a key the group's schema lacks (with the nearest), a value of the wrong
    type. A packaged option of the same name is the one Hydra composes: a config dir's file of that name is not
    read."""
    chosen = {group: [DEFAULTS[group]] for group in GROUPS}
    sweep, builds_here = _sweep(argv), _builds_here(argv)
    for prefix, key, value in _overrides(argv):
        if not prefix and key in GROUPS:
            chosen[key] = value.split(",") if sweep else [value]
    for group, options in chosen.items():
        for root in dirs:
            for option in options:
                path = Path(root).expanduser() / group / ("%s.yaml" % option)
                if path.is_file() and not (CONFIGS / group / ("%s.yaml" % option)).is_file():
                    why = _yaml_mistake(path, group, keys, sweep, builds_here)
                    if why:
                        return "--config-dir %s: %s" % (root, why)
    return None


def _yaml_mistake(path: Path, group: str, keys: Dict[str, Any], sweep: bool, builds_here: bool) -> Optional[str]:
    """What is wrong in one group option's YAML file, against the schema (None: nothing this check knows)."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
        data = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError) as e:
        return "%s cannot be read (%s)" % (path, getattr(e, "strerror", None) or e)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        return "%s is not valid YAML (%s%s); fix that line" % (
            path, getattr(e, "problem", None) or type(e).__name__, ", line %d" % (mark.line + 1) if mark else "")
    package = re.search(r"^#\s*@package\s+(\S+)", text, re.M)
    if package and package.group(1) != "_global_":
        return None  # placed elsewhere in the config: Hydra judges it
    base = "" if package else group + "."
    if data is None:
        return None
    if not isinstance(data, dict):
        return "%s holds a YAML %s; a %s config is a mapping of its keys (name: ..., ...)" % (
            path, type(data).__name__, group)
    for key, value in _flat(data, base):
        if key in (base + "defaults", "defaults"):
            continue
        if key not in keys:
            near = _nearest(key[len(base):], [k[len(base):] for k in keys if k.startswith(base)])
            return "%s: `%s: %s`: a %s config has no key %s; %s" % (
                path, key[len(base):], value, group, key[len(base):],
                "did you mean `%s`?" % near if near else "`laya-aot build --help` lists every key")
        if not isinstance(value, (list, dict)):
            text_value = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            why = _wrong_value(key, text_value, keys[key], sweep, builds_here)
            if why:
                return "%s: %s" % (path, why)
    return None


def _flat(data: Dict[str, Any], prefix: str) -> Iterator[Tuple[str, Any]]:
    """(dotted key, value) of a nested mapping; a mapping value that is a section of the schema is walked."""
    for key, value in data.items():
        if isinstance(value, dict) and value:
            yield from _flat(value, "%s%s." % (prefix, key))
        else:
            yield "%s%s" % (prefix, key), value


def implied_overrides(argv: List[str]) -> List[str]:
    """What `checkpoint.path=DIR` over the default (demo) checkpoint config means, spelled out for Hydra, so that
    the config the build prints (`--cfg job`) is the one it builds: the checkpoint named after DIR
    (`checkpoint.path_name`, as `checkpoint.describe` names it), no demo shape. Nothing where the command line picks
    a checkpoint config, a name or a demo shape itself, or sweeps paths."""
    from ..checkpoint import path_name

    sweep = _sweep(argv)
    found = {key: value for prefix, key, value in _overrides(argv) if not prefix}
    path = found.get("checkpoint.path")
    if not path or path == "null" or _quoted_or_interpolated(path) or (sweep and "," in path) or \
            any(k in found for k in ("checkpoint", "checkpoint.name", "checkpoint.demo_shape")):
        return []
    name = path_name(path).replace("\\", "\\\\").replace("'", "\\'")
    return ["checkpoint.name='%s'" % name, "checkpoint.demo_shape=null"]


def with_implied(argv: List[str]) -> List[str]:
    """`argv` with `implied_overrides` placed right after the `checkpoint.path=` they spell out: Hydra reads its
    overrides as one run of positional arguments, so appended after a flag (`checkpoint.path=DIR --cfg job`) they
    would be arguments it does not know."""
    implied = implied_overrides(argv)
    at = [i for i, prefix, key, _ in _placed_overrides(argv) if key == "checkpoint.path" and not prefix]
    if not implied or not at:
        return list(argv)
    return [*argv[:at[-1] + 1], *implied, *argv[at[-1] + 1:]]


def _quoted_or_interpolated(value: str) -> bool:
    """A value Hydra reads in its own grammar (quoted, or an interpolation): not a plain path to look at."""
    return "${" in value or value[:1] in ("'", '"')


def _wrong_value(key: str, value: str, t: Any, sweep: bool, builds_here: bool) -> Optional[str]:
    if key == "checkpoint.path" and Path(value).expanduser().is_file():
        return "checkpoint.path=%s is a file; pass the checkpoint directory%s" % (value, _parent_hint(Path(value)))
    if key == "checkpoint.path" and builds_here and value not in ("null", "") and not _quoted_or_interpolated(value):
        from ..checkpoint import CheckpointError, check_layout

        try:
            check_layout(Path(value).expanduser())
        except CheckpointError as e:
            return str(e)
    if key == "output_dir" and Path(value).is_file():
        return "output_dir=%s is a file; pass the directory the bundle goes to (absent, empty, or a bundle)" % value
    base = [a for a in typing.get_args(t) if a is not type(None)] or [t]
    if len(base) != 1 or value in ("null", "") or (sweep and "," in value) or "${" in value:
        return None
    kind = base[0]
    try:
        if kind is bool and value.lower() not in _TRUE_FALSE:
            raise ValueError
        if kind is int:
            int(value)
        elif kind is float:
            float(value)
    except ValueError:
        return "`%s=%s`: %s takes %s" % (key, value, key, {bool: "true or false", int: "a whole number",
                                                           float: "a number"}[kind])
    return None
