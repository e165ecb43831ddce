"""Markdown tables from `nmcli bench kernels --json` runs (BENCHMARKS.md's and README's), several
runs together: the later file's row wins where two time the same shape, row count and pattern.

    nmcli bench kernels --shapes llama --json > llama.json
    python scripts/bench_table.py llama.json               # every point
    python scripts/bench_table.py llama.json --ranges      # speedup ranges over the shapes

Where the runs timed cuSPARSELt 2:4 (nmcli bench kernels does unless --no-cusparselt), its time and
speedup over cuBLAS come after cuBLAS's, and its range first.
"""
import argparse
import json

from nmcli.bench_kernels import markdown_table, speedup_ranges


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="JSON files written by nmcli bench kernels --json")
    parser.add_argument("--ranges", action="store_true", help="speedup ranges per row count and pattern")
    args = parser.parse_args()
    rows: dict[tuple, dict] = {}
    for path in args.runs:
        with open(path) as f:
            for row in json.load(f)["rows"]:
                rows[(row["k"], row["n"], row["m"], row["nm"])] = row
    print((speedup_ranges if args.ranges else markdown_table)(list(rows.values())), end="")


if __name__ == "__main__":
    main()
