"""`python -m ktlong.config`: the configuration in force, the plan it makes for a model, the
user file's path, and configs/default.yaml rendered from the declarations."""

from __future__ import annotations

import argparse

from ktlong.cli import print_error
from ktlong.config import DEFAULT_FILE, load_config, show, user_config_path
from ktlong.errors import ConfigError, KtlongError
from ktlong.options import render_defaults


def build_parser() -> argparse.ArgumentParser:
    from ktlong.session.startup import add_config_flags

    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m ktlong.config", description="Show the configuration in force, "
                                "or what a long-context session would run with it.")
    p.add_argument("command", choices=["show", "path", "defaults"], help="show: every option, its value and "
                   "where it came from (with --plan: the resolved plan for the model instead); path: the user "
                   "config file; defaults: write configs/default.yaml from the declarations in ktlong/options.py")
    p.add_argument("--plan", action="store_true", help="show: the plan a long-context session of the model would "
                   "run, every auto resolved (reads the GGUF's header, no weights)")
    add_config_flags(p)  # the options as local_chat.py takes them
    return p


def plan_text(config) -> str:
    """The long-context plan of config's model on this machine (ktlong/session/plan.py)."""
    from ktlong.device import resolve_device, resolve_dtype
    from ktlong.gguf.model_config import RopeOptions
    from ktlong.models.loader import open_model
    from ktlong.session.plan import plan_for_file

    gf, model_config = open_model(config.model, RopeOptions.of(config))
    max_seq_len = config.check_against_model(model_config.num_layers, model_config.context_length)
    device = resolve_device(config.device)
    plan = plan_for_file(config, gf, model_config, max_seq_len, device, resolve_dtype(config.dtype, device),
                         config.tensor_parallel)
    try:
        plan.check()
        verdict = "[it fits this machine]"
    except ConfigError as e:
        verdict = f"[it does not fit: {e}]"
    return f"{gf.path.name}: {model_config.arch}, {model_config.num_layers} layers\n{plan.describe()}\n{verdict}"


def main(argv: list[str] | None = None) -> int:
    from ktlong.session.startup import overrides_from

    args = build_parser().parse_args(argv)
    try:
        if args.command == "path":
            print(user_config_path())
        elif args.command == "defaults":
            tmp = DEFAULT_FILE.with_suffix(".yaml.tmp")
            tmp.write_text(render_defaults())
            tmp.replace(DEFAULT_FILE)
            print(f"wrote {DEFAULT_FILE}")
        else:
            config = load_config(args.config, overrides_from(args))
            print(plan_text(config) if args.plan else show(config))
    except KtlongError as e:
        print_error(e)
        return 2
    return 0
