"""Summaries of evaluation results: the terminal table and the needle heatmap."""

from __future__ import annotations

from collections import defaultdict
from statistics import median

from ktlong.eval.runner import same_answers


def summary_rows(results) -> list[list]:
    """One row per (length, depth): accuracy and speeds per attention mode, side by side."""
    cells = defaultdict(list)
    for r in results:
        cells[(r.length, r.depth, r.attention)].append(r)
    modes = sorted({r.attention for r in results}, key=lambda m: (m != "dense", m))
    rows = []
    for length, depth in sorted({(r.length, r.depth) for r in results}):
        row = [length, f"{depth:.2f}"]
        for mode in modes:
            rs = cells.get((length, depth, mode), [])
            if not rs:
                row += ["-"] * 4
                continue
            correct = sum(r.correct for r in rs)
            row += [f"{correct}/{len(rs)}", f"{median(r.prefill_tokens_per_second for r in rs):,.0f}",
                    f"{median(r.decode_tokens_per_second for r in rs):.1f}",
                    f"{median(r.density for r in rs):.0%}"]
        rows.append(row)
    headers = ["length", "depth"]
    for mode in modes:
        headers += [f"{mode} acc", f"{mode} prefill tok/s", f"{mode} decode tok/s", f"{mode} density"]
    return headers, rows


GRID_CELL_SLACK = 2  # issue 62's grid: no cell more than this many samples below the base arm
GRID_SUM_SLACK = 0.03  # and each arm's sum over the cells at least the base's sum less this share of it


def grid_rows(results, base: str = "dense") -> tuple[list[str], list[list], list[str]]:
    """The grid over tasks and lengths: one row per (task, length), each arm's right answers of
    its samples, and how often each other arm gave the base's own answer (runner.same_answers: a
    measure of fidelity that a weak model's wrong answers do not blur); then per arm against
    `base`, on the prompts both ran: the cells more than GRID_CELL_SLACK below it and the sums
    over the cells (at least the base's less GRID_SUM_SLACK of it). An arm that has not run every
    prompt the base ran does not hold: its verdict names the cells it lacks (a run split over
    processes, or cut short)."""
    cells = defaultdict(dict)  # (task, length, arm) -> {(depth, sample): right}
    for r in results:
        cells[(r.task, r.length, r.attention)][(r.depth, r.sample)] = r.correct
    arms = sorted({r.attention for r in results}, key=lambda m: (m != base, m))
    keys = sorted({(r.task, r.length) for r in results})
    others = arms[1:] if base in arms else []
    agreed = {(task, arm): same_answers([r for r in results if r.task == task], arm, base)
              for task in {t for t, _ in keys} for arm in others}  # per length: (same, both ran)

    def same(task, length, arm) -> str:  # the prompts on which arm answered as base did, of those both ran
        both = agreed[(task, arm)].get(length)
        return f"{both[0]}/{both[1]}" if both else "-"

    rows = [[task, length] + [f"{sum(cells[(task, length, a)].values())}/{len(cells[(task, length, a)])}"
                              if cells.get((task, length, a)) else "-" for a in arms]
            + [same(task, length, a) for a in others] for task, length in keys]
    verdicts = []
    if base in arms:
        for arm in arms[1:]:
            below, lacking, total, base_sum = [], [], 0, 0
            for t, n in keys:
                ours, theirs = cells.get((t, n, arm), {}), cells.get((t, n, base), {})
                common = ours.keys() & theirs.keys()
                right, base_right = sum(ours[k] for k in common), sum(theirs[k] for k in common)
                total, base_sum = total + right, base_sum + base_right
                if base_right - right > GRID_CELL_SLACK:
                    below.append(f"{t} {n:,} ({right} against {base_right})")
                if theirs.keys() - ours.keys():
                    lacking.append(f"{t} {n:,} ({len(common)} of {len(theirs)})")
            holds = not below and not lacking and total >= (1 - GRID_SUM_SLACK) * base_sum
            verdicts.append(f"{arm}: {total} right against {base}'s {base_sum} (at least {(1 - GRID_SUM_SLACK) * base_sum:.1f} "
                            f"asked); cells more than {GRID_CELL_SLACK} below {base}: {', '.join(below) or 'none'}"
                            + (f"; prompts of {base}'s not run: {', '.join(lacking)}" if lacking else "")
                            + f": {'holds' if holds else 'does not hold'}")
    return ["task", "length"] + arms + [f"{a} = {base}" for a in others], rows, verdicts


def prefill_rows(results, base: str = "dense") -> tuple[list[str], list[list]]:
    """Per length and arm against `base`: median prefill seconds end to end and of attention
    (its block selection included), their speedups over the base arm, the seconds that building
    the decoder adds before the first token, and the density CompactAttention kept."""
    by = defaultdict(list)
    for r in results:
        by[(r.length, r.attention)].append(r)
    rows = []
    for length in sorted({r.length for r in results}):
        ref = by.get((length, base))
        for arm in sorted({r.attention for r in results if r.length == length and r.attention != base}):
            rs = by[(length, arm)]
            e2e, attn = median(r.prefill_seconds for r in rs), median(r.prefill_attention_seconds for r in rs)
            setup = median(r.decode_setup_seconds for r in rs)
            row = [length, arm, f"{e2e:.2f}", f"{attn:.2f}" if attn else "-", f"{setup:.2f}",
                   f"{median(r.density for r in rs):.0%}"]
            if ref:
                ref_e2e, ref_attn = (median(r.prefill_seconds for r in ref),
                                     median(r.prefill_attention_seconds for r in ref))
                row += [f"{ref_e2e:.2f}", f"{ref_attn:.2f}" if ref_attn else "-",
                        f"{ref_e2e / e2e:.2f}x" if e2e else "-", f"{ref_attn / attn:.2f}x" if attn and ref_attn else "-"]
            else:
                row += ["-"] * 4
            rows.append(row)
    headers = ["length", "arm", "prefill s", "attention s", "decoder set-up s", "density", f"{base} prefill s",
               f"{base} attention s", "speedup", "attention speedup"]
    return headers, rows


def needle_heatmap(results, attention: str, path: str):
    """Depth (rows) x length (columns) accuracy, red (0) to green (1), one PNG per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rs = [r for r in results if r.attention == attention]
    lengths = sorted({r.length for r in rs})
    depths = sorted({r.depth for r in rs})
    grid = np.full((len(depths), len(lengths)), np.nan)
    for i, d in enumerate(depths):
        for j, n in enumerate(lengths):
            cell = [r.correct for r in rs if r.depth == d and r.length == n]
            if cell:
                grid[i, j] = sum(cell) / len(cell)
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(lengths), 1.2 + 0.6 * len(depths)))
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n >= 1024 else str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title("needle, " + attention.replace("@", "\n"), fontsize=9)  # an arm's options one per line
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.0%}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return grid
