"""Where a result was measured (GPU, commit, date, versions) and how it is written to --out."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megamoe.bench.report import provenance
from megamoe.bench.timing import Device


def environment(device: torch.device, module: str, argv: list[str]) -> dict[str, str]:
    """provenance() of a training result, and the transformers version."""
    try:
        import transformers
        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = "not installed"
    return {**provenance(Device(device).name(), module, argv), "transformers": transformers_version}


def write_result(result: dict, out_dir: Path, name: str) -> Path:
    """<name>_latest.json plus a dated copy (<name>_<date>_<commit>.json) that later runs keep.
    Returns the latest path; a plot goes next to it with the same stem."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2) + "\n"
    (out_dir / f"{name}_{result['date'][:10]}_{result['commit']}.json").write_text(text)
    latest = out_dir / f"{name}_latest.json"
    latest.write_text(text)
    return latest
