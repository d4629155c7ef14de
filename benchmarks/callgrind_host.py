"""Instructions of one `bench_host` serve, per source tree: a measure of the host path
that, unlike wall time on a shared machine, repeats to within a fraction of a percent.

    python -m benchmarks.callgrind_host --trees /tmp/before . [--requests 300] [--record]

Per tree: valgrind's instruction count (`--tool=callgrind`) of a process serving
`bench_host`'s workload twice, less one serving it once, so imports, building the
workload and warm-up cancel. Every run gets `PYTHONHASHSEED=0` (dict layouts move the
count) and `OPENBLAS_NUM_THREADS=1` (idle BLAS threads add up to ~2% of noise). The first
tree is the baseline of the table's ratios. Each serve under callgrind takes about a
minute. Needs `valgrind` on PATH.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._common import add_record_option, print_table, write_json

# Serves `bench_host`'s workload `n` times through the tree's own scheduler and manager.
_SERVE = (
    "import sys; from benchmarks import bench_host as bh; "
    "w = bh.make_workload(int(sys.argv[2])); "
    "[bh.serve(bh.JaxkvEngine(w, 'sha256'), w) for _ in range(int(sys.argv[1]))]"
)


def instructions(tree: Path, serves: int, requests: int, out_dir: Path) -> int:
    """Instructions of a process in `tree` serving the workload `serves` times."""
    out = out_dir / f"{tree.name or 'tree'}.{serves}.out"
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1")
    subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
         "-c", _SERVE, str(serves), str(requests)],
        cwd=tree, env=env, check=True, capture_output=True,
    )  # fmt: skip
    match = re.search(r"^(?:summary|totals):\s+(\d+)", out.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no instruction total in {out}")
    return int(match.group(1))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", type=Path, required=True, help="source trees")
    parser.add_argument("--requests", type=int, default=300, help="requests in the workload")
    add_record_option(parser)
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not on PATH")
    per_serve: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tree in args.trees:
            tree = tree.resolve()
            once = instructions(tree, 1, args.requests, Path(tmp))
            twice = instructions(tree, 2, args.requests, Path(tmp))
            per_serve[str(tree)] = twice - once
    base = next(iter(per_serve.values()))
    print_table(
        f"instructions of one bench_host serve ({args.requests} requests, sha256)",
        ["tree", "M instructions", "vs first"],
        [[tree, n / 1e6, n / base] for tree, n in per_serve.items()],
    )
    result = {"requests": args.requests, "instructions_per_serve": per_serve}
    write_json("callgrind_host", result, args.record)
    return result


if __name__ == "__main__":
    main()
