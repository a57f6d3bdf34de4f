"""Where a kernel's warps spend their time, by source line: reads the CSV that
`ncu -i <report> --page source --csv --print-source cuda,sass` writes for a report taken with
`--section SourceCounters --import-source yes` (ncu_kernels.sh does both with NCU_SOURCE set) and
prints the warp-state samples per source file and the lines with the most, with their main stall
reasons. Inlined code counts at its innermost line (a helper's line, not its caller's).

    python scripts/experiments/ncu_source_lines.py source.csv [--lines 30]
"""

from __future__ import annotations

import argparse
import collections
import csv
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_lines(path: Path) -> list[tuple[str, int, dict[str, float]]]:
    """(file, line, metrics) per source line. The source text can break the CSV quoting, so a line's
    metrics are read from the end of its row, where the header puts them."""
    lines, file, header = [], "", []
    with path.open() as text:
        for row in csv.reader(text):
            if not row:
                continue
            if row[0] == "File Path":
                file = row[1]
            elif row[0] == "Line No":
                header = row[2:]
            elif row[0].isdigit() and header:
                metrics = {}
                for name, value in zip(header, row[-len(header):]):
                    try:
                        metrics[name] = float(value)
                    except ValueError:
                        pass
                lines.append((file, int(row[0]), metrics))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--lines", type=int, default=30, help="how many of the busiest lines to print")
    args = parser.parse_args()
    lines = read_lines(args.csv)
    total = sum(m.get(SAMPLES, 0.0) for _, _, m in lines) or 1.0
    by_file, executed = collections.Counter(), collections.Counter()
    for file, _, m in lines:
        by_file[file] += m.get(SAMPLES, 0.0)
        executed[file] += m.get(EXECUTED, 0.0)
    print(f"{total:.0f} warp samples; per file: share of samples, warp instructions executed")
    for file, samples in by_file.most_common():
        if samples:
            print(f"{samples / total:6.1%} {executed[file] / 1e6:8.1f} M  {file}")
    print("busiest lines: share, warp instructions, the three largest stall reasons")
    for file, line, m in sorted(lines, key=lambda entry: -entry[2].get(SAMPLES, 0.0))[:args.lines]:
        samples = m.get(SAMPLES, 0.0)
        stalls = sorted(((v, k[len("stall_"):]) for k, v in m.items()
                         if k.startswith("stall_") and "Not Issued" not in k), reverse=True)[:3]
        reasons = " ".join(f"{name} {v / samples:.0%}" for v, name in stalls if samples)
        print(f"{samples / total:6.1%} {m.get(EXECUTED, 0.0) / 1e6:7.1f} M  {Path(file).name}:{line}  {reasons}")


if __name__ == "__main__":
    main()
