"""Configuration: configs/default.yaml <- user file <- --config FILE <- command line.

The default file is the one source of defaults and comments; `Config` names every option
and checks every value. `python -m ktlong.config show` prints what is in force and why.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import reprlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ktlong.errors import ConfigError
from ktlong.options import OPTIONS, SECTIONS, Option
from ktlong.regular_file import user_path

DEFAULT_FILE = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"

SECRETS = ("api_key",)
# options that no longer exist -> why, for the message that asks to delete them
REMOVED = {"device_cache_blocks": "the GPU reads the selected blocks from DRAM itself (context_attention: gpu)",
           "cpu_int4": "cpu_stored_weights keeps quantised matrices as the GGUF stores them",
           "cpu_bf16": "cpu_stored_weights keeps quantised matrices as the GGUF stores them"}
MAX_CONFIG_BYTES = 1 << 20  # a config file is a few KiB of 'option: value' lines


@dataclass(slots=True)
class Config:
    """One value per option of ktlong/options.py (the fields are made from its declarations),
    checked when made."""
    __annotations__ = {name: o.type for name, o in OPTIONS.items()} | {"sources": "dict[str, str]"}
    # where each value came from ("default", "FILE:LINE", "--set", "--flag")
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        for o in OPTIONS.values():
            setattr(self, o.name, _checked_type(o, getattr(self, o.name), self.where(o.name)))
            value = getattr(self, o.name)
            if o.choices and value not in o.choices:
                self._fail(o.name, f"must be one of {', '.join(o.choices)}")
            if isinstance(value, float) and not math.isfinite(value):
                self._fail(o.name, "must be a finite number")
            if o.low is not None and ((value <= o.low if o.low_exclusive else value < o.low)
                                      or (o.high is not None and value > o.high)):
                bound = f"{'above' if o.low_exclusive else 'at least'} {o.low}" + (
                    f" and at most {o.high}" if o.high is not None else "")
                self._fail(o.name, f"must be {bound}")
        cores = os.cpu_count() or 1
        if self.threads_num > cores:
            self._fail("threads_num", f"is more than this machine's {cores} cores; use at most {cores} "
                                      "(0: every core but one)")
        if self.block_size & (self.block_size - 1):
            self._fail("block_size", "must be a power of two (16, 32, ..., 4096)")
        if self.chunk_size % self.block_size:
            self._fail("chunk_size", f"must be a multiple of block_size ({self.block_size})")
        if not (self.device in ("auto", "cpu", "cuda") or
                (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            self._fail("device", "must be auto, cpu, cuda or cuda:N")

    def with_overrides(self, overrides: dict[str, tuple[object, str]]) -> "Config":
        """This config with parse_set's {key: (value, where)} set over it, checked again."""
        values = {k: v for k, (v, _) in overrides.items()}
        return dataclasses.replace(self, **values, sources={**self.sources, **{k: w for k, (_, w) in overrides.items()}})

    def where(self, key: str) -> str:
        return self.sources.get(key, "default")

    def _fail(self, key: str, rule: str):
        raise ConfigError(f"Option '{key}' = {shown_value(key, getattr(self, key))} (from {self.where(key)}) {rule}.")

    def check_against_model(self, num_layers: int, context_length: int) -> int:
        """Refuse settings that cannot work with this model; return the effective max_seq_len."""
        for key in ("dense_layer_num", "prefill_dense_layer_num"):
            if getattr(self, key) > num_layers:
                raise ConfigError(f"{key} ({getattr(self, key)}, from {self.where(key)}) exceeds the model's "
                                  f"{num_layers} layers; set it to at most {num_layers}.")
        return self.max_seq_len or context_length

    def local_window_for(self, max_seq_len: int, sliding_window: int) -> int:
        """The long-context device window: local_windows_len, or all of a shorter max_seq_len (a
        short document sits in the window whole). It covers the model's sliding window, whose
        layers read nothing else."""
        if sliding_window and self.local_windows_len < sliding_window:
            raise ConfigError(f"local_windows_len ({self.local_windows_len}) is shorter than the model's sliding "
                              f"window ({sliding_window}); set local_windows_len to at least {sliding_window}.")
        return min(self.local_windows_len, max_seq_len)


def option_names() -> list[str]:
    return list(OPTIONS)


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 60
_SHORT_REPR.maxlist = _SHORT_REPR.maxdict = 4
_SHORT_REPR.maxlevel = 2


def shown_value(key: str, value) -> str:
    """A value as a message shows it: a secret never, anything else cut to 60 characters (a
    YAML alias bomb under a key would otherwise take minutes and gigabytes to format)."""
    if key in SECRETS:
        return "(hidden)"
    return _SHORT_REPR.repr(value)


def _checked_type(o: Option, value, where: str):
    if o.type == "auto_bool":
        if isinstance(value, bool) or value == "auto":
            return value
        raise ConfigError(f"Option '{o.name}' = {shown_value(o.name, value)} (from {where}) must be true, false "
                          "or auto.")
    kind = {"str": str, "int": int, "float": float, "bool": bool}[o.type]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is str and value is None:
        return ""
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    if o.choices:  # e.g. a bare off, which YAML reads as false
        raise ConfigError(f"Option '{o.name}' = {shown_value(o.name, value)} (from {where}) must be one of "
                          f"{', '.join(o.choices)}.")
    raise ConfigError(f"Option '{o.name}' = {shown_value(o.name, value)} (from {where}) must be "
                      f"a{'n' if kind is int else ''} {kind.__name__}.")


def user_config_path() -> Path:
    root = os.environ.get("XDG_CONFIG_HOME") or os.path.join(Path.home(), ".config")
    return Path(root) / "ktlong" / "config.yaml"


MAX_YAML_DEPTH = 8  # options are scalars; a few levels leave room for a list of them


class OptionsLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping and nesting deeper than
    MAX_YAML_DEPTH (before its recursion could reach Python's limit)."""

    depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"it nests deeper than {MAX_YAML_DEPTH} levels",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)):  # unhashable keys: SafeLoader refuses them
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {str(key)[:60]!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(text: str):
    """text's YAML value, read by OptionsLoader."""
    return yaml.load(text, Loader=OptionsLoader)


def read_yaml_options(path: Path) -> dict[str, tuple[object, str]]:
    """Read a flat YAML mapping of options: {key: (value, "path:line")}, unknown keys refused."""
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"Config file {path} is larger than {MAX_CONFIG_BYTES // 1024} KiB; a config "
                              "holds one 'option: value' line per option.")
        text = path.read_text(encoding="utf-8")
        node = yaml.compose(text, Loader=OptionsLoader)
        values = load_yaml(text)
    except OSError as e:
        raise ConfigError(f"Cannot read config file {path} ({e.strerror}); check the path.") from None
    except UnicodeDecodeError:
        raise ConfigError(f"Config file {path} is not UTF-8 text; give a YAML file of 'option: value' "
                          "lines.") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}" if mark else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())[:200]  # one line, whatever YAML says
        raise ConfigError(f"Config file {path}{at} is not valid YAML ({problem}); fix the syntax there.") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"Config file {path} must be a mapping of 'option: value' lines.")
    lines = {k.value: k.start_mark.line + 1 for k, _ in node.value}
    known = option_names()
    out = {}
    for key, value in values.items():
        where = f"{path}:{lines.get(key, '?')}"
        if key not in known:
            raise ConfigError(unknown_key_message(str(key), where))
        out[key] = (value, where)
    return out


def unknown_key_message(key: str, where: str) -> str:
    if key in REMOVED:
        return f"Option '{key}' at {where} no longer exists ({REMOVED[key]}); delete it."
    close = difflib.get_close_matches(key, option_names(), n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'?" if close else "see configs/default.yaml for every option."
    return f"Unknown option {_SHORT_REPR.repr(key)} at {where}; {hint}"


def parse_set(items: list[str]) -> dict[str, tuple[object, str]]:
    """--set key=value pairs; values are read as YAML scalars (128, true, MAX, 0.5)."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(f"--set {item!r} needs the form key=value, e.g. --set block_size=64.")
        if key not in option_names():
            raise ConfigError(unknown_key_message(key, f"--set {item}"))
        try:
            value = load_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError:
            raise ConfigError(f"--set {key}: {raw[:60]!r} is not a YAML value; quote it, e.g. "
                              f"--set '{key}=\"...\"'.") from None
        out[key] = (value, f"--set {key}")
    return out


def options_in(*sections: str) -> frozenset[str]:
    """The options of ktlong/options.py's sections, named by their titles' first words
    ("long-context prefill" for "long-context prefill (CompactAttention)")."""
    found = {title.split(" (")[0]: [o.name for o in options] for title, options in SECTIONS}
    unknown = set(sections) - set(found)
    assert not unknown, f"ktlong/options.py has no section {unknown}; it has {list(found)}"
    return frozenset(name for section in sections for name in found[section])


def greedy_session_options() -> frozenset[str]:
    """What a command that runs long-context sessions greedily, at lengths of its own, reads:
    every option but sampling's, the server's, mode and max_seq_len."""
    return (frozenset(option_names()) - options_in("server", "generation") - {"mode", "max_seq_len"}
            | {"use_chat_template", "chat_template_file"})


def refuse_unread(overrides: dict[str, tuple[object, str]], reads: frozenset[str], command: str, why: str):
    """A command refuses an option it would not read, rather than run as if it were not given.
    why: what the command does, which says why the option does not apply."""
    for key, (_, where) in overrides.items():
        if key not in reads:
            raise ConfigError(f"{where}: {command} {why}, and '{key}' does not change that; leave it out.")


USER_FILE_HEADER = """\
# Your ktlong settings. Every option is listed commented out at its default; uncomment a
# line and change its value to override it. Options you leave commented follow the
# defaults of the installed ktlong, so new options and improved defaults reach this file.
"""


def commented_defaults() -> str:
    lines = [USER_FILE_HEADER]
    for line in DEFAULT_FILE.read_text().splitlines():
        is_option = line and not line.startswith("#")
        lines.append(f"# {line}" if is_option else line)
    return "\n".join(lines) + "\n"


def ensure_user_file(path: Path) -> bool:
    """Write the commented defaults to the user's file on first run; True when it was written."""
    if path.exists():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(commented_defaults())
    return True


def default_config(**values) -> Config:
    """The defaults with `values` set over them (no user file)."""
    defaults = {name: o.default for name, o in OPTIONS.items()}
    return Config(**{**defaults, **values}, sources={k: "code" for k in values})


def load_config(config_file: str | None = None, overrides: dict[str, tuple[object, str]] | None = None,
                user_file: Path | None = None, write_user_file: bool = True) -> Config:
    layers = [{name: (o.default, "default") for name, o in OPTIONS.items()}]
    user_file = user_file or user_config_path()
    if write_user_file and ensure_user_file(user_file):
        print(f"ktlong: wrote the default configuration to {user_file}", file=sys.stderr)
    if user_file.exists():
        layers.append(read_yaml_options(user_file))
    if config_file:
        layers.append(read_yaml_options(user_path(config_file)))
    layers.append(overrides or {})
    merged, sources = {}, {}
    for i, layer in enumerate(layers):
        for key, (value, where) in layer.items():
            merged[key] = value
            sources[key] = "default" if i == 0 else where
    return Config(**merged, sources=sources)


def show(config: Config) -> str:
    width = max(map(len, option_names()))
    def shown(name):  # a secret is shown as set or not, never printed
        value = getattr(config, name)
        return ("'(set)'" if value else "''") if name in SECRETS else repr(value)

    rows = [f"{name:<{width}}  {shown(name):<16}  {config.where(name)}" for name in option_names()]
    return "\n".join(rows)


if __name__ == "__main__":  # python -m ktlong.config: the command sits above the engine
    from ktlong.config_command import main

    sys.exit(main())
