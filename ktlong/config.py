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

DEFAULT_FILE = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"

ENUMS = {
    "mode": ("normal", "long_context"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "prefill_attention": ("dense", "compact"),
    "context_attention": ("auto", "cpu", "gpu"),
    "selector": ("flashprefill", "xattention", "topk"),
    "attention_backend": ("auto", "fa2", "fa3", "torch"),
    "kv_type": ("auto", "bf16", "fp16", "fp32", "q8_0", "q4_0"),
    "rope_scaling": ("auto", "none", "linear", "yarn"),
    "anchor_type": ("MAX", "MEAN", "QUEST", "DYNAMIC", "FIX"),
    "head_select_mode": ("SHARED", "SEPARATE"),
    "block_scoring": ("auto", "device", "cpu"),
}
# options that are true, false or "auto" (decided from the device and mode at run time)
AUTO_BOOLS = ("use_cuda_graph",)
SECRETS = ("api_key",)
# options that no longer exist -> why, for the message that asks to delete them
REMOVED = {"device_cache_blocks": "the GPU reads the selected blocks from DRAM itself (context_attention: gpu)"}
MAX_CONFIG_BYTES = 1 << 20  # a config file is a few KiB of 'option: value' lines
# key -> (lowest allowed, highest allowed, lowest is exclusive)
RANGES = {
    "max_seq_len": (0, None, False), "gpu_memory_budget_gb": (0, None, True),
    "rope_scale": (0, None, False), "yarn_orig_ctx": (0, None, False),
    "chunk_size": (1, None, False), "alpha": (0, 1, False), "threshold": (0, 1, True),
    "dense_above": (0, 1, True), "tail_queries": (0, None, False), "dense_tail": (0, None, False),
    "prefill_dense_layer_num": (0, None, False),
    "keep_blocks": (1, None, False), "stride": (1, None, False), "sink_blocks": (0, None, False),
    "window_blocks": (0, None, False),
    "subgroup_size": (1, None, False), "block_size": (16, 4096, False),
    "local_windows_len": (0, None, False), "second_select_num": (0, None, False),
    "anchor_num": (1, None, False), "dense_layer_num": (0, None, False),
    "preselect_block_count": (1, None, False), "layer_step": (1, None, False),
    "token_step": (1, None, False), "threads_num": (0, None, False),
    "max_new_tokens": (1, None, False), "temperature": (0, None, False), "top_p": (0, 1, True),
    "top_k": (0, None, False), "port": (1, 65535, False), "queue_size": (0, None, False),
    "tensor_parallel": (1, None, False), "seed": (0, (1 << 63) - 1, False),
}


@dataclass(slots=True)
class Config:
    model: str
    mode: str
    device: str
    dtype: str
    max_seq_len: int
    rope_scaling: str
    rope_scale: float
    yarn_orig_ctx: int
    gpu_memory_budget_gb: float
    use_cuda_graph: bool | str  # True, False or "auto"
    resident_history: bool
    tensor_parallel: int
    chunk_size: int
    prefill_attention: str
    selector: str
    alpha: float
    keep_blocks: int
    threshold: float
    stride: int
    sink_blocks: int
    window_blocks: int
    subgroup_size: int
    dense_above: float
    tail_queries: int
    dense_tail: int
    prefill_dense_layer_num: int
    attention_backend: str
    block_size: int
    kv_type: str
    local_windows_len: int
    second_select_num: int
    anchor_type: str
    anchor_num: int
    head_select_mode: str
    dense_layer_num: int
    preselect_block: bool
    preselect_block_count: int
    layer_step: int
    token_step: int
    block_scoring: str
    context_attention: str
    threads_num: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    use_chat_template: bool
    system_prompt: str
    host: str
    port: int
    queue_size: int
    api_key: str
    # where each value came from ("default", "FILE:LINE", "--set", "--flag")
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        for f in option_fields():
            setattr(self, f.name, _checked_type(f, getattr(self, f.name), self.where(f.name)))
        for key, allowed in ENUMS.items():
            if getattr(self, key) not in allowed:
                self._fail(key, f"must be one of {', '.join(allowed)}")
        for key, (low, high, exclusive) in RANGES.items():
            value = getattr(self, key)
            if isinstance(value, float) and not math.isfinite(value):
                self._fail(key, "must be a finite number")
            if (value <= low if exclusive else value < low) or (high is not None and value > high):
                bound = f"{'above' if exclusive else 'at least'} {low}" + (
                    f" and at most {high}" if high is not None else "")
                self._fail(key, f"must be {bound}")
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


def option_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(Config) if f.name != "sources"]


def option_names() -> list[str]:
    return [f.name for f in option_fields()]


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


def _checked_type(f: dataclasses.Field, value, where: str):
    if f.name in AUTO_BOOLS:
        if isinstance(value, bool) or value == "auto":
            return value
        raise ConfigError(f"Option '{f.name}' = {shown_value(f.name, value)} (from {where}) must be true, false "
                          "or auto.")
    kind = {"str": str, "int": int, "float": float, "bool": bool}[f.type]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is str and value is None:
        return ""
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"Option '{f.name}' = {shown_value(f.name, value)} (from {where}) must be "
                      f"a{'n' if kind is int else ''} {kind.__name__}.")


def user_config_path() -> Path:
    root = os.environ.get("XDG_CONFIG_HOME") or os.path.join(Path.home(), ".config")
    return Path(root) / "ktlong" / "config.yaml"


def read_yaml_options(path: Path) -> dict[str, tuple[object, str]]:
    """Read a flat YAML mapping of options: {key: (value, "path:line")}, unknown keys refused."""
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"Config file {path} is larger than {MAX_CONFIG_BYTES // 1024} KiB; a config "
                              "holds one 'option: value' line per option.")
        text = path.read_text(encoding="utf-8")
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        values = yaml.safe_load(text)
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
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            raise ConfigError(f"--set {key}: {raw[:60]!r} is not a YAML value; quote it, e.g. "
                              f"--set '{key}=\"...\"'.") from None
        out[key] = (value, f"--set {key}")
    return out


def options_in(*sections: str) -> frozenset[str]:
    """The options of configs/default.yaml's sections, named by their headers' first words
    ("long-context prefill" for "# ---- long-context prefill (CompactAttention) ----")."""
    found, current = {}, None
    for line in DEFAULT_FILE.read_text().splitlines():
        if line.startswith("# ---- "):
            current = line.removeprefix("# ---- ").removesuffix(" ----").split(" (")[0]
            found[current] = []
        elif line and not line.startswith("#") and current is not None:
            found[current].append(line.split(":", 1)[0].strip())
    unknown = set(sections) - set(found)
    assert not unknown, f"configs/default.yaml has no section {unknown}; it has {list(found)}"
    return frozenset(name for section in sections for name in found[section])


def greedy_session_options() -> frozenset[str]:
    """What a command that runs long-context sessions greedily, at lengths of its own, reads:
    every option but sampling's, the server's, mode and max_seq_len."""
    return (frozenset(option_names()) - options_in("server", "generation") - {"mode", "max_seq_len"}
            | {"use_chat_template"})


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
    """The defaults of configs/default.yaml with `values` set over them (no user file)."""
    options = {k: v for k, (v, _) in read_yaml_options(DEFAULT_FILE).items()}
    return Config(**{**options, **values}, sources={k: "code" for k in values})


def load_config(config_file: str | None = None, overrides: dict[str, tuple[object, str]] | None = None,
                user_file: Path | None = None, write_user_file: bool = True) -> Config:
    layers = [read_yaml_options(DEFAULT_FILE)]
    user_file = user_file or user_config_path()
    if write_user_file and ensure_user_file(user_file):
        print(f"ktlong: wrote the default configuration to {user_file}", file=sys.stderr)
    if user_file.exists():
        layers.append(read_yaml_options(user_file))
    if config_file:
        layers.append(read_yaml_options(Path(config_file)))
    layers.append(overrides or {})
    merged, sources = {}, {}
    for i, layer in enumerate(layers):
        for key, (value, where) in layer.items():
            merged[key] = value
            sources[key] = "default" if i == 0 else where
    missing = set(option_names()) - set(merged)
    assert not missing, f"configs/default.yaml lacks {missing}"
    return Config(**merged, sources=sources)


def show(config: Config) -> str:
    width = max(map(len, option_names()))
    def shown(name):  # a secret is shown as set or not, never printed
        value = getattr(config, name)
        return ("'(set)'" if value else "''") if name in SECRETS else repr(value)

    rows = [f"{name:<{width}}  {shown(name):<16}  {config.where(name)}" for name in option_names()]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ktlong.config",
                                     description="Show the configuration in force.")
    parser.add_argument("command", choices=["show", "path"], help="show: every option, its value "
                        "and where it came from; path: the user config file")
    parser.add_argument("--config", help="an extra YAML file merged over the user file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        if args.command == "path":
            print(user_config_path())
            return 0
        print(show(load_config(args.config, parse_set(args.set))))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
