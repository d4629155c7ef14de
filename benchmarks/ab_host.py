"""A/B harness: one benchmark command in two source trees, interleaved rounds, per-round ratios.

    python -m benchmarks.ab_host --a /tmp/before --b . --rounds 6 \\
        --a-cmd "python benchmarks/bench_host.py --peer vllm --repeats 3" \\
        --cmd "python -m benchmarks.bench_host --peer vllm --repeats 3" \\
        --rows jaxkv/sha256_cbor,jaxkv/sha256
    python -m benchmarks.ab_host --a . --b . --rounds 6 --rows ...   # A/A: the noise floor

Each run is a fresh process started in its tree (that tree on PYTHONPATH, this
Python's bin directory first on PATH). Rounds alternate the order (A B, B A, ...:
ABBA), so a slow phase of the shared machine falls on both trees alike. A run's
figures are read from the tables it prints: a row whose first cell is one of
`--rows` gives its second cell (the benchmarks' tables put the configuration
first and its CPU seconds second). Per round the ratio B/A is taken per row;
the summary is the median and range of those ratios, and of each tree's figures.

The comparison is only as good as the rounds: on a shared 2-core machine single
runs differ by 10-20%, so use at least 6 rounds and compare against an A/A run.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks._common import add_record_option, print_table, write_json

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


def parse_rows(output: str, rows: list[str]) -> dict[str, float]:
    """The second cell of each table row named in `rows` (the last such row printed wins)."""
    values: dict[str, float] = {}
    for line in output.splitlines():
        match = re.match(rf"\s*(\S+)\s+({_NUMBER})(?:\s|$)", line)
        if match and match.group(1) in rows:
            values[match.group(1)] = float(match.group(2))
    missing = [row for row in rows if row not in values]
    if missing:
        raise SystemExit(f"rows {missing} not found in the output:\n{output[-3000:]}")
    return values


def run_once(tree: Path, command: str, rows: list[str], timeout: float) -> dict[str, float]:
    """Run `command` through the shell in `tree`, in a fresh process; its figures for `rows`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.pop("JAXKV_BENCH_IN_PEER", None)
    done = subprocess.run(
        command, shell=True, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode:
        raise SystemExit(f"`{command}` in {tree} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return parse_rows(done.stdout, rows)


def summarize(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--a", required=True, type=Path, help="tree A (the baseline)")
    parser.add_argument("--b", required=True, type=Path, help="tree B (the candidate)")
    parser.add_argument(
        "--cmd",
        default="python -m benchmarks.bench_host --peer vllm --repeats 3",
        help="command run in each tree (shell syntax)",
    )
    parser.add_argument("--a-cmd", help="command for tree A when it differs (an older layout)")
    parser.add_argument("--rows", required=True, help="comma-separated table rows to compare")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds (>= 6)")
    parser.add_argument("--name", default="ab_host", help="JSON file name (benchmarks/out/)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    add_record_option(parser)
    args = parser.parse_args()

    rows = [row for row in args.rows.split(",") if row]
    trees = {"A": args.a.resolve(), "B": args.b.resolve()}
    commands = {"A": args.a_cmd or args.cmd, "B": args.cmd}
    figures: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for round_index in range(args.rounds):
        order = "AB" if round_index % 2 == 0 else "BA"
        for side in order:
            figures[side].append(run_once(trees[side], commands[side], rows, args.timeout))
        ratios = {row: figures["B"][-1][row] / figures["A"][-1][row] for row in rows}
        print(
            f"round {round_index + 1}/{args.rounds} ({order}): "
            + ", ".join(
                f"{row} A {figures['A'][-1][row]:.4g} B {figures['B'][-1][row]:.4g} "
                f"B/A {ratios[row]:.3f}"
                for row in rows
            ),
            flush=True,
        )

    summary: dict[str, dict[str, list[float]]] = {}
    table = []
    for row in rows:
        a = [f[row] for f in figures["A"]]
        b = [f[row] for f in figures["B"]]
        ratios = [y / x for x, y in zip(a, b, strict=True)]
        summary[row] = {"a": a, "b": b, "b_over_a": ratios}
        table.append([row, statistics.median(a), statistics.median(b), *summarize(ratios)])
    print_table(
        f"\nA = {trees['A']}: {commands['A']}\nB = {trees['B']}: {commands['B']}\n"
        f"{args.rounds} interleaved rounds (ABBA); per-round ratio B/A",
        ["row", "A median", "B median", "B/A median", "B/A min", "B/A max"],
        table,
    )
    write_json(
        args.name,
        {
            "command": " ".join(sys.argv),
            "trees": {side: str(tree) for side, tree in trees.items()},
            "commands": commands,
            "rounds": args.rounds,
            "rows": summary,
        },
        record=args.record,
    )


if __name__ == "__main__":
    main()
