"""The JSON result file (a stable contract) and the printed table."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from .peak import Peaks
from .record import Record

# Where a run writes unless --out says otherwise: a folder under the current directory (`runs/` is
# ignored by git in a checkout). The repository's records (bench/results/) are only updated on
# purpose, with an explicit --out bench/results.
DEFAULT_OUT = Path("runs/bench")


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR",
                        help=f"folder for the results (default: {DEFAULT_OUT} under the current directory; "
                             "the repository's records are updated with --out bench/results)")


def build_result(records: list[Record], peaks: Peaks, gpu: str, argv: list[str], settings: dict) -> dict:
    return {
        **provenance(gpu, "megamoe.bench", argv),
        "peak_bf16_tflops": peaks.bf16_tflops,
        "peak_fp8_tflops": peaks.fp8_tflops,
        "peak_gemm_size": peaks.gemm_size,
        "peak_bf16_sm_mhz": peaks.bf16_sm_mhz,
        "settings": settings,
        "records": [dataclasses.asdict(r) for r in records],
    }


def provenance(gpu: str, module: str | None = None, argv: list[str] | None = None) -> dict:
    """Where and how a result was measured: GPU, commit, UTC date, torch version and, for a module run
    from the command line, the command (`python -m <module> <argv>`; argv None: this process's)."""
    result = {"gpu": gpu, "commit": git_commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__}
    if module is not None:
        result["command"] = f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv)
    return result


def git_commit() -> str:
    """Short hash of the checkout this package runs from, "-dirty" with uncommitted changes to tracked
    files (untracked ones, such as fresh results, do not count, as with `git describe --dirty`).
    MEGAMOE_COMMIT overrides it, for copies of the tree without .git (e.g. on a benchmark machine)."""
    if os.environ.get("MEGAMOE_COMMIT"):
        return os.environ["MEGAMOE_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        sha = _git(here, "rev-parse", "--short", "HEAD")
        dirty = _git(here, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def write_json(result: dict, out_dir: Path) -> list[Path]:
    """latest.json plus a dated copy (<date>_<commit>.json) that later runs do not overwrite."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2) + "\n"
    paths = [out_dir / f"{result['date'][:10]}_{result['commit']}.json", out_dir / "latest.json"]
    for path in paths:
        path.write_text(text)
    return paths


COLUMNS = ("preset", "tokens", "routing", "backend", "prec",
           "fwd ms", "1 call", "TFLOPS", "% peak", "× grouped", "MHz",
           "fwd+bwd ms", "1 call", "TFLOPS", "% peak", "× grouped", "MHz",
           "mem GB", "saved GB", "skipped")
TEXT_COLUMNS = {0, 2, 3, 4, len(COLUMNS) - 1}  # left-aligned; the numbers are right-aligned


def table_rows(result: dict) -> list[tuple[str, ...]]:
    rows = []
    for r in result["records"]:
        row = [r["preset"], str(r["tokens"]), r["routing"], r["backend"], r["precision"]]
        for mode in ("fwd", "fwdbwd"):
            row += [_fmt(r[f"{mode}_ms"], ".2f"), _fmt(r.get(f"{mode}_single_ms"), ".2f"),
                    _fmt_tflops(r[f"{mode}_tflops"]),
                    _fmt(r[f"{mode}_pct_bf16_peak"], ".0f"), _fmt(r[f"{mode}_vs_grouped"], ".2f"),
                    _fmt(r.get(f"{mode}_sm_mhz"), ".0f")]
        row += [_fmt(r["peak_mem_gb"], ".1f"), _fmt(r["saved_gb"], ".2f"), _shorten(r["skipped"] or "", 60)]
        rows.append(tuple(row))
    return rows


def print_table(result: dict) -> None:
    title = (f"{result['gpu']}  commit {result['commit']}  torch {result['torch']}  "
             f"dense {result['peak_gemm_size']}³ peak: bf16 {_fmt_tflops(result['peak_bf16_tflops'])} TFLOPS"
             f" at {_fmt(result.get('peak_bf16_sm_mhz'), '.0f')} MHz, "
             f"fp8 {_fmt_tflops(result['peak_fp8_tflops'])} TFLOPS")
    rows = table_rows(result)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is optional: plain text
        print(title)
        widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(COLUMNS)]
        for line in (COLUMNS, *rows):
            cells = (c.ljust(w) if i in TEXT_COLUMNS else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
            print("  ".join(cells).rstrip())
        return
    table = Table(title=title)
    for i, column in enumerate(COLUMNS):
        table.add_column(column, justify="left" if i in TEXT_COLUMNS else "right")
    for row in rows:
        table.add_row(*row)
    # Not a terminal (a log file): rich would wrap the table at 80 columns.
    Console(width=None if sys.stdout.isatty() else 240).print(table)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _fmt_tflops(value: float | None) -> str:
    """Whole numbers on a GPU; three significant digits for the tiny CPU figures."""
    return _fmt(value, ".0f" if value is None or value >= 100 else ".3g")


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
