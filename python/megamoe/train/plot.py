"""Loss-curve and step-time PNGs (matplotlib, an optional extra: `pip install ".[plot]"`)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from megamoe.bench.plot import pyplot as _pyplot


def write_if_plotting(write: Callable[..., None], path: Path, *args, **kwargs) -> bool:
    """write(..., path, ...) if matplotlib is there; else a note on stderr, and no PNG at path (an older
    one would no longer match the results). The results stand without their plot."""
    try:
        write(*args, path, **kwargs)
        return True
    except ImportError as error:
        path.unlink(missing_ok=True)
        print(f"{path.name} not written: {error}", file=sys.stderr)
        return False


def write_loss_curve(steps: Sequence[int], losses: Sequence[float], path: Path, title: str,
                     floor: float | None = None, evaluations: Sequence[tuple[int, float]] = ()) -> None:
    """The training loss by step, with the held-out loss at `evaluations` (step, loss) if any."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, label="language-model loss")
    if evaluations:
        ax.plot(*zip(*evaluations), marker="o", label="held-out loss")
    if floor is not None:
        ax.axhline(floor, color="gray", linestyle="--", label=f"synthetic-data floor {floor:.2f}")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_parity_plot(curves: Mapping[str, Sequence[float]], reference: str, path: Path, title: str) -> None:
    """Top: every backend's loss per step; bottom: each one's difference to the reference."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(2, 1))
    for index, (name, losses) in enumerate(curves.items()):
        steps = range(1, len(losses) + 1)
        color = f"C{index}"  # the same colour for a backend in both panels
        top.plot(steps, losses, label=name, linewidth=1, color=color)
        if name != reference:
            diffs = [a - b for a, b in zip(losses, curves[reference])]
            bottom.plot(steps, diffs, label=f"{name} − {reference}", linewidth=1, color=color)
    top.set(ylabel="loss (nats/token)", title=title)
    top.legend()
    bottom.axhline(0, color="gray", linewidth=0.5)
    bottom.set(xlabel="step", ylabel="loss difference")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_step_plot(records: Sequence[Mapping], path: Path, title: str) -> None:
    """Tokens/s of each timed record of a variant, with its step time and peak memory written beside the
    bar; skipped records are left out."""
    plt = _pyplot()
    timed = [r for r in records if not r.get("skipped")]
    names = [r["variant"] for r in timed]
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.5 * len(timed)))
    bars = ax.barh(names, [r["tokens_per_s"] for r in timed], color=[f"C{i}" for i in range(len(timed))])
    for bar, r in zip(bars, timed):
        memory = f", peak {r['peak_mem_gb']:.1f} GB" if r.get("peak_mem_gb") is not None else ""
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {r['step_ms']:.0f} ms/step{memory}",
                va="center")
    ax.invert_yaxis()
    ax.set(xlabel="tokens/s", title=title)
    ax.set_xlim(0, 1.45 * max(r["tokens_per_s"] for r in timed))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
