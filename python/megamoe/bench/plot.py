"""PNG chart of a result: TFLOPS per backend and token count, one panel per (preset, routing, mode).

matplotlib is an optional extra (`pip install ".[plot]"`), imported only when a chart is drawn."""

from __future__ import annotations

import itertools
from pathlib import Path

from .record import MODES

MODE_TITLES = {"fwd": "forward", "fwdbwd": "forward + backward"}
PLOT_HINT = 'plotting needs matplotlib: pip install ".[plot]" (or pip install matplotlib)'


def pyplot():
    """matplotlib.pyplot, drawing to files only (benchmark and training machines have no display);
    ImportError with PLOT_HINT when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(PLOT_HINT) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_chart(result: dict, paths: list[Path]) -> None:
    plt = pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    records = result["records"]
    several_precisions = len({r["precision"] for r in records}) > 1

    def label(r: dict) -> str:
        return f"{r['backend']} {r['precision']}" if several_precisions else r["backend"]

    modes = [m for m in MODES if any(r[f"{m}_tflops"] is not None for r in records)] or ["fwd"]
    # Only series with at least one bar; skipped backends are listed in the table and JSON instead.
    series = list(dict.fromkeys(label(r) for r in records if any(r[f"{m}_tflops"] is not None for m in modes)))
    palette = plt.get_cmap("tab10" if len(series) <= 10 else "tab20")  # one colour per series
    colors = {name: palette(i) for i, name in enumerate(series)}
    panels = list(dict.fromkeys((r["preset"], r["routing"]) for r in records))

    fig, axes = plt.subplots(len(panels), len(modes), squeeze=False, layout="constrained",
                             figsize=(6.5 * len(modes), 3.6 * len(panels) + 0.6))
    width = 0.8 / max(len(series), 1)
    for (row, (preset, routing)), (col, mode) in itertools.product(enumerate(panels), enumerate(modes)):
        ax = axes[row][col]
        case = [r for r in records if (r["preset"], r["routing"]) == (preset, routing)]
        tokens = sorted({r["tokens"] for r in case})
        for i, name in enumerate(series):
            offset = (i - (len(series) - 1) / 2) * width
            bars = [(x + offset, r[f"{mode}_tflops"]) for x, t in enumerate(tokens) for r in case
                    if r["tokens"] == t and label(r) == name and r[f"{mode}_tflops"] is not None]
            if bars:
                ax.bar(*zip(*bars), width, color=colors[name])
        ax.axhline(result["peak_bf16_tflops"], color="black", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(tokens)), [str(t) for t in tokens])
        ax.set_xlabel("tokens")
        ax.set_ylabel("TFLOPS")
        ax.set_title(f"{preset}, {routing} routing, {MODE_TITLES[mode]}", fontsize=10)

    handles = [Patch(color=colors[name], label=name) for name in series]
    handles.append(Line2D([], [], color="black", linestyle="--", label="measured dense bf16 peak"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 4), fontsize=9, frameon=False)
    fig.suptitle(f"megamoe.bench · {result['gpu']} · {result['commit']} · {result['date'][:10]}", fontsize=11)
    for path in paths:
        fig.savefig(path, dpi=120)
    plt.close(fig)
