"""An evaluation's results.json: written whole after every sample, read back checked, so that a
run cut short, or split over processes or machines, goes on where it stopped (--resume)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ktlong.config import Config, greedy_session_options
from ktlong.errors import KtlongError
from ktlong.eval.runner import Result
from ktlong.regular_file import NotRegularFile, TooLarge, read_regular, write_replacing

MAX_BYTES = 256 << 20  # a results file larger than this is not one of ours: refused before it is read
FIELD_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}


def run_settings(config: Config, model_name: str, seed: int) -> dict:
    """What makes two runs' answers comparable: the model file, the samples' seed and every
    option a greedy session reads (an arm's own options travel in its name)."""
    return {"model": model_name, "seed": seed,
            "options": {name: getattr(config, name) for name in sorted(greedy_session_options())}}


def as_dicts(results: list[Result]) -> list[dict]:
    return [dataclasses.asdict(r) for r in results]


def write_json(path: Path, value) -> None:
    write_replacing(path, lambda f: f.write(json.dumps(value, indent=1).encode()))


def save(path: Path, task: str, settings: dict, device: str, results: list[Result]) -> None:
    write_json(path, {"task": task, "settings": settings, "device": device, "results": as_dicts(results)})


def read_earlier(path: Path, task: str, settings: dict) -> list[Result]:
    """The results an earlier run of the same task and settings saved at path ([] where there is
    no file), each checked field by field; a file of another run is refused in one sentence."""
    if not path.exists():
        return []
    fix = "give another --out, or move it away"
    try:
        saved = json.loads(read_regular(path, MAX_BYTES))
    except NotRegularFile as e:
        raise KtlongError(f"{path} {e}; {fix}.") from None
    except TooLarge:
        raise KtlongError(f"{path} is larger than {MAX_BYTES >> 20} MiB, not an evaluation's results; {fix}.") from None
    except (OSError, ValueError) as e:
        raise KtlongError(f"cannot read {path} as an evaluation's results ({e}); {fix}.") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("results"), list):
        raise KtlongError(f"{path} is not an evaluation's results file; {fix}.")
    if saved.get("task") != task:
        raise KtlongError(f"{path} holds results of task {saved.get('task')!r}, not {task!r}; {fix}.")
    if saved.get("settings") != settings:
        raise KtlongError(f"{path} was measured with other settings ({_difference(saved.get('settings'), settings)}); "
                          f"{fix}, or run with its settings.")
    fields = {f.name: FIELD_TYPES[f.type] for f in dataclasses.fields(Result)}
    results = []
    for i, r in enumerate(saved["results"]):
        if not (isinstance(r, dict) and r.keys() == fields.keys() and r.get("task") == task
                and all(isinstance(r[k], t) and (bool not in t or type(r[k]) is bool) for k, t in fields.items())):
            raise KtlongError(f"{path}: result {i} is not one this version writes; {fix}.")
        results.append(Result(**r))
    return results


def _difference(saved, settings: dict) -> str:
    """The first few settings that differ, 'keep_blocks: 128 there, 192 here'."""
    if not isinstance(saved, dict):
        return "none recorded"
    flat = lambda s: {**{k: v for k, v in s.items() if k != "options"},
                      **(s["options"] if isinstance(s.get("options"), dict) else {})}
    there, here = flat(saved), flat(settings)
    differ = [f"{k}: {there.get(k, '-')} there, {here.get(k, '-')} here" for k in sorted(there.keys() | here.keys())
              if there.get(k) != here.get(k)]
    return "; ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
