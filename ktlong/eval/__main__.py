"""python -m ktlong.eval TASK[,TASK...]|all --model NAME_OR_GGUF --lengths 2k,4k,8k --samples N
    --attention dense,sparse [--depths 0,0.25,0.5,0.75,1] [--seed S] [--out DIR] [--set key=value]

Runs TASK (passkey, needle, kvretrieval, multikey; RULER's multivalue, multiquery, vartrack,
commonwords, freqwords and qa) through the long-context path of
local_chat.py --mode long_context: layer-major prefill (CompactAttention when sparse) and
sparse decode, with the model's chat template, dense and sparse on the same prompts. Several
tasks (or all) run one after another on the model loaded once, each into DIR/TASK/results.json,
and end with the grid: every (task, length) cell per arm, and each arm against dense (no cell
more than 2 below it, the sum over the cells at least dense's less 3%).
"""

from __future__ import annotations

import argparse
import re
import sys

from ktlong.cli import in_range, interrupted, parse_lengths, print_error, print_table
from ktlong.eval.tasks import TASKS
from ktlong.regular_file import user_path

MAX_SAMPLES = 10_000  # per cell: RULER runs hundreds; their list is made before the first runs
WHY_OPTIONS = "runs each task greedily in long-context mode at the --lengths given"  # what no option changes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m ktlong.eval", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tasks", metavar="TASK[,TASK...]|all", help=f"what to ask: {', '.join(sorted(TASKS))}; several "
                   "comma-separated, or all")
    p.add_argument("--model", default=None, help="packaged model name or GGUF path (default: smollm2-135m)")
    p.add_argument("--lengths", default="2k,4k,8k", help="target prompt lengths in the model's tokens, comma-separated: a count, or with k (1024) "
                   "or m (1048576), e.g. 4096,32k,1m (default: %(default)s)")
    p.add_argument("--samples", type=int, default=10, help="samples per (length, depth) (default: %(default)s)")
    p.add_argument("--attention", default="dense,sparse",
                   help="arms, comma-separated: dense, sparse (CompactAttention prefill and sparse decode), "
                        "sparse-prefill or sparse-decode (one stage sparse, to tell which loses an answer), "
                        "transformers (the same GGUF run by transformers, SDPA: the dense arm's reference); "
                        "an arm with options of its own: sparse@selector=xattention@threshold=0.95 "
                        "(default: %(default)s)")
    p.add_argument("--depths", default=None, help="needle depths in [0, 1]; default 0.5 (needle: 0,.25,.5,.75,1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the samples' texts and needles (default: %(default)s)")
    p.add_argument("--out", default="results", help="folder for results.json (and heatmaps) (default: %(default)s)")
    p.add_argument("--resume", action="store_true",
                   help="go on with the results.json already in --out (a run cut short, or one split over processes "
                        "or machines, each with its own tasks or arms): its samples are kept, not run again, when it "
                        "was measured with the same model, seed and options; without it, a results.json there is "
                        "refused rather than overwritten")
    p.add_argument("--device", default=None, help="auto, cpu, cuda (default: the config's device)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config option that changes a greedy session (repeatable)")
    p.add_argument("--tensor_parallel", type=int, default=None, metavar="N",
                   help="split the model over N ranks; start with torchrun --nproc_per_node N")
    args = p.parse_args(argv)

    from ktlong.config import greedy_session_options, load_config, parse_set, refuse_unread
    from ktlong.device import resolve_device, resolve_dtype
    from ktlong.errors import KtlongError
    from ktlong.gguf.chat_template import configured_template
    from ktlong.eval.report import grid_rows
    from ktlong.eval.results_file import read_earlier, run_settings, save
    from ktlong.eval.runner import run_task, split_variant, variant_config
    from ktlong.models.loader import load_model, open_model
    from ktlong.gguf.model_config import RopeOptions
    from ktlong.gguf.weights import CpuWeights
    from ktlong.parallel.group import join_ranks
    from ktlong.parallel.launch import quiet_unless_main
    from ktlong.session.settings import ARMS

    quiet_unless_main()

    try:
        overrides = parse_set(args.set)
        refuse_unread(overrides, greedy_session_options(), "python -m ktlong.eval", WHY_OPTIONS)
        if args.model:
            overrides["model"] = (args.model, "--model")
        if args.device:
            overrides["device"] = (args.device, "--device")
        if args.tensor_parallel is not None:
            overrides["tensor_parallel"] = (args.tensor_parallel, "--tensor_parallel")
        config = load_config(overrides=overrides)
        tasks = sorted(TASKS) if args.tasks == "all" else [t.strip() for t in args.tasks.split(",")]
        unknown = [t for t in tasks if t not in TASKS]
        if unknown or len(set(tasks)) < len(tasks):
            raise KtlongError(f"{args.tasks!r}: name tasks of {', '.join(sorted(TASKS))} once each, comma-separated, "
                              "or all.")
        attentions = [a.strip() for a in args.attention.split(",")]
        arms = [split_variant(a) for a in attentions]
        if not {arm for arm, _ in arms} <= set(ARMS) | {"transformers"}:
            raise KtlongError(f"--attention {args.attention!r}: use arms of {', '.join(ARMS)} and transformers, "
                              "e.g. dense,sparse.")
        if any(arm == "transformers" and settings for arm, settings in arms):
            raise KtlongError(f"--attention {args.attention!r}: the transformers arm takes no options of its own.")
        if len(set(attentions)) < len(attentions):
            raise KtlongError(f"--attention {args.attention!r} names an arm twice; name each once.")
        for attention in attentions:
            arm_options = parse_set(split_variant(attention)[1])
            refuse_unread({k: (v, f"--attention {attention}") for k, (v, _) in arm_options.items()},
                          greedy_session_options(), "python -m ktlong.eval", WHY_OPTIONS)
            variant_config(config, attention)  # a bad option is refused before the model loads
        bad_depths = KtlongError(f"--depths {args.depths!r}: give numbers in [0, 1], e.g. --depths 0,0.5,1.")
        try:
            depths = {t: [float(d) for d in (args.depths or ("0,0.25,0.5,0.75,1" if t == "needle" else "0.5")).split(",")]
                      for t in tasks}
        except ValueError:
            raise bad_depths from None
        if not all(0 <= d <= 1 for ds in depths.values() for d in ds):
            raise bad_depths
        # each (length, depth) cell's list of samples is made before any runs
        in_range("--samples", args.samples, 1, MAX_SAMPLES, "the samples per (length, depth) cell")
        lengths = parse_lengths(args.lengths)
        out = user_path(args.out)
        if out.exists() and not out.is_dir():
            raise KtlongError(f"--out {args.out} is a file; give a folder for results.json (it is made if missing).")
        folders = {t: out if len(tasks) == 1 else out / t for t in tasks}  # several: a folder each
        for t in tasks:
            if (folders[t] / "results.json").exists() and not args.resume:
                raise KtlongError(f"{folders[t] / 'results.json'} holds an earlier run; give another --out, or "
                                  "--resume to go on with it.")
        device = resolve_device(config.device)
        if config.tensor_parallel > 1 and "transformers" in attentions:
            raise KtlongError("The transformers arm runs in one process; leave it out of --attention "
                              "or run with --tensor_parallel 1.")
        _, model_config = open_model(config.model, RopeOptions.of(config))
        tp, device = join_ranks(config.tensor_parallel, model_config, device)  # every rank runs the same prompts
        lm = load_model(config.model, device, resolve_dtype(config.dtype, device), RopeOptions.of(config), tp,
                        configured_template(config.chat_template_file), CpuWeights.of(config))
        if max(lengths) > lm.config.context_length:
            raise KtlongError(f"--lengths up to {max(lengths)} exceed the model's context of "
                              f"{lm.config.context_length} tokens; use shorter lengths.")
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KtlongError(f"cannot make --out {args.out} ({e.strerror}); give a folder you can write.") from None
        main_rank = tp is None or tp.is_main

        settings = run_settings(config, lm.path.name, args.seed)
        earlier = {t: read_earlier(folders[t] / "results.json", t, settings) if args.resume else []
                   for t in tasks}  # every file checked before any sample runs

        def saver(task):
            def on_result(results):  # after every sample: a run cut short keeps what it measured
                if main_rank:
                    folders[task].mkdir(exist_ok=True)
                    save(folders[task] / "results.json", task, settings, str(device), results)
            return on_result

        by_task = {t: run_task(lm, config, t, lengths, depths[t], args.samples, attentions, args.seed,
                               on_result=saver(t), earlier=earlier[t]) for t in tasks}
    except KtlongError as e:
        print_error(e)
        return 2
    except KeyboardInterrupt:
        return interrupted(f"the samples measured are in {args.out}; add --resume to go on from them")
    if tp is not None and not tp.is_main:
        return 0  # rank 0 reports
    for task, results in by_task.items():
        report(task, results, attentions, args.samples, lm.path.name, device, folders[task])
    if len(tasks) > 1:
        headers, rows, verdicts = grid_rows([r for results in by_task.values() for r in results])
        print(f"the grid: right answers of {args.samples} per cell")
        print_table(headers, rows)
        print("\n".join(verdicts))
    return 0


def report(task, results, attentions, samples, model_name, device, out) -> None:
    """A task's tables: accuracy and speeds per cell, prefill against dense, agreement with
    transformers, the needle's heatmaps."""
    from ktlong.eval.report import needle_heatmap, prefill_rows, summary_rows
    from ktlong.eval.runner import same_answers

    headers, rows = summary_rows(results)
    print(f"{task} on {model_name} ({device}), {samples} samples per cell")
    print_table(headers, rows)
    if "dense" in attentions and len(attentions) > 1:
        print("prefill, medians per cell (seconds; attention alone from CUDA events, or wall clock on the CPU):")
        print_table(*prefill_rows(results))
    if {"dense", "transformers"} <= set(attentions):
        for length, (same, total) in same_answers(results, "dense", "transformers").items():
            print(f"dense and transformers gave the same answer on {same}/{total} prompts at {length:,} tokens")
    if task == "needle":
        for attention in attentions:
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", attention)  # sparse@selector=xattention: sparse_selector_xattention
            needle_heatmap(results, attention, str(out / f"needle_{name}.png"))
    print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    sys.exit(main())
