"""Run vLLM's own ``tests/v1/core`` unit tests against jaxkv: the yardstick of issues #10/#11.

    python tools/vllm_core_yardstick.py /path/to/vllm/tests/v1/core [--json out.json]

Copies the chosen test files (`DEFAULT_FILES`, those present) into a temporary
directory, rewriting only their import statements: every ``import``/``from ...
import`` of ``vllm.*`` or ``torch`` (at any depth, e.g. inside a test) becomes a
lookup through `tools/vllm_yardstick_shim.py`, which maps vLLM's names to
jaxkv's (torch dtypes to numpy dtypes). Test bodies stay byte-for-byte as vLLM
wrote them. A name with no jaxkv equivalent becomes a placeholder that fails
only the tests touching it, naming the name.

It then runs pytest there and prints, per file: total, passed, failed, errors,
skipped, and the failures grouped by cause (the missing vLLM name, or the
exception type and first line). ``--json`` writes the same per test.

``--target vllm --python /path/to/.venv-vllm/bin/python`` runs the same rewritten
files against vLLM itself (the baseline: how many pass on vLLM);
``--compare baseline.json`` then counts, per file, how many of the tests passing
there pass against jaxkv. The target
interpreter needs no pytest of its own: this interpreter's pytest is appended to
its ``sys.path``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

TOOLS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TOOLS_DIR.parent
SHIM_MODULE = "vllm_yardstick_shim"
SHIM_ALIAS = "_jaxkv_yardstick"

DEFAULT_FILES = (
    "test_prefix_caching.py",
    "test_kv_cache_utils.py",
    "test_single_type_kv_cache_manager.py",
    "test_encoder_cache_manager.py",
    "test_block_pool.py",
    "test_hybrid_kv_cache_coordinator.py",
)

CONFTEST = """\
def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_test: vLLM's marker for CPU-only tests")
"""


def _is_mapped(module: str) -> bool:
    top = module.split(".")[0]
    return top in ("vllm", "torch")


def _import_replacement(node: ast.Import | ast.ImportFrom) -> str | None:
    """The shim lookup replacing `node`, or None to keep the statement as it is."""
    if isinstance(node, ast.ImportFrom):
        if node.level or node.module is None or not _is_mapped(node.module):
            return None
        targets = [alias.asname or alias.name for alias in node.names]
        wanted = ", ".join(repr(alias.name) for alias in node.names)
        lhs = targets[0] if len(targets) == 1 else ", ".join(targets)
        return f"{lhs} = {SHIM_ALIAS}.names({node.module!r}, {wanted})"
    if not any(_is_mapped(alias.name) for alias in node.names):
        return None
    statements = []
    for alias in node.names:
        if not _is_mapped(alias.name):
            statements.append(
                f"import {alias.name}" + (f" as {alias.asname}" if alias.asname else "")
            )
        elif alias.asname or "." not in alias.name:
            name = alias.asname or alias.name
            statements.append(f"{name} = {SHIM_ALIAS}.module({alias.name!r})")
        else:
            top = alias.name.split(".")[0]
            statements.append(f"{top} = {SHIM_ALIAS}.root({alias.name!r})")
    return "; ".join(statements)


def rewrite_imports(source: str) -> str:
    """`source` with its vLLM/torch imports routed through the shim; nothing else changes.

    Each rewritten import statement keeps its first line's indentation and is
    padded with blank lines to its original height, so line numbers stay valid.
    """
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            replacement = _import_replacement(node)
            if replacement is not None:
                edits.append((node.lineno, node.end_lineno, node.col_offset, replacement))
    for lineno, end_lineno, col, replacement in sorted(edits, reverse=True):
        first = lines[lineno - 1]
        if first[:col].strip() or lines[end_lineno - 1].rstrip("\n").rstrip().endswith(";"):
            raise ValueError(f"line {lineno}: an import sharing its line is not supported")
        height = end_lineno - lineno + 1
        lines[lineno - 1 : end_lineno] = [first[:col] + replacement + "\n"] + ["\n"] * (height - 1)
    # The shim import goes on the first line: a vLLM test file starts with comments.
    return f"import {SHIM_MODULE} as {SHIM_ALIAS}  # noqa\n" + "".join(lines)


def _pytest_site() -> str:
    import pytest

    return str(Path(pytest.__file__).resolve().parent.parent)


def run_pytest(workdir: Path, python: str, target: str, junit: Path, extra: list[str]) -> int:
    env = dict(os.environ)
    env["JAXKV_YARDSTICK_TARGET"] = target
    env["PYTHONPATH"] = os.pathsep.join(
        [str(workdir), str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env.pop("PYTHONHASHSEED", None)
    # vLLM's config tests name Hugging Face models; never reach for the network.
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    launcher = (
        "import sys; sys.path.append(sys.argv.pop(1)); import pytest; "
        "sys.exit(pytest.main(sys.argv[1:]))"
    )
    # pytest runs in `workdir`: a relative interpreter path is taken from here, not there
    # (abspath, not resolve: a venv's python is a symlink that must keep its venv).
    python = os.path.abspath(python) if os.sep in python else shutil.which(python) or python
    cmd = [
        python,
        "-c",
        launcher,
        _pytest_site(),
        str(workdir),
        "-q",
        "-rN",
        "--tb=short",
        "--continue-on-collection-errors",
        "-p",
        "no:cacheprovider",
        "-o",
        "junit_family=xunit2",
        f"--junitxml={junit}",
        "--rootdir",
        str(workdir),
        *extra,
    ]
    return subprocess.run(cmd, cwd=workdir, env=env, check=False).returncode


_MISSING = re.compile(r"NoJaxkvEquivalentError: (\S+) has no equivalent")


def failure_cause(message: str, text: str) -> str:
    """A short cause for grouping: the missing name, else the exception and its first line."""
    found = _MISSING.search(text) or _MISSING.search(message)
    if found:
        return f"missing: {found.group(1)}"
    first = (message or text).strip().splitlines()[0] if (message or text).strip() else "?"
    return first[:160]


def parse_junit(junit: Path) -> dict[str, list[dict]]:
    """Per test file, one record per test: name, outcome, cause."""
    results: dict[str, list[dict]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        classname = case.get("classname", "")
        file = classname.split(".")[0] + ".py" if classname else case.get("name", "?") + ".py"
        outcome, cause = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                cause = failure_cause(child.get("message", ""), child.text or "")
                break
        results.setdefault(file, []).append(
            {"test": case.get("name"), "outcome": outcome, "cause": cause}
        )
    return results


def summarise(results: dict[str, list[dict]]) -> dict[str, dict]:
    summary = {}
    for file, records in sorted(results.items()):
        counts = Counter(r["outcome"] for r in records)
        causes = Counter(r["cause"] for r in records if r["outcome"] in ("failed", "error"))
        summary[file] = {
            "total": len(records),
            "passed": counts["passed"],
            "failed": counts["failed"],
            "error": counts["error"],
            "skipped": counts["skipped"],
            "causes": dict(causes.most_common()),
        }
    return summary


def compare(results: dict[str, list[dict]], baseline: dict[str, list[dict]]) -> dict[str, dict]:
    """Per file, against a baseline run (``--target vllm``): the tests that pass there,
    and how many of those pass here; plus the tests passing here but not there."""
    rows = {}
    for file in sorted(set(results) | set(baseline)):
        here = {r["test"] for r in results.get(file, []) if r["outcome"] == "passed"}
        there = {r["test"] for r in baseline.get(file, []) if r["outcome"] == "passed"}
        rows[file] = {
            "pass_baseline": len(there),
            "pass_both": len(here & there),
            "pass_only_here": len(here - there),
            "fail_here_pass_baseline": sorted(there - here),
        }
    return rows


def print_summary(summary: dict[str, dict], target: str, show_causes: bool) -> None:
    print(f"vLLM v1/core unit tests against {target}")
    header = f"{'file':42} {'total':>5} {'pass':>5} {'fail':>5} {'error':>5} {'skip':>5}"
    print(header)
    print("-" * len(header))
    totals = Counter()
    for file, row in summary.items():
        print(
            f"{file:42} {row['total']:5} {row['passed']:5} {row['failed']:5} "
            f"{row['error']:5} {row['skipped']:5}"
        )
        totals.update({k: row[k] for k in ("total", "passed", "failed", "error", "skipped")})
    print("-" * len(header))
    print(
        f"{'all':42} {totals['total']:5} {totals['passed']:5} {totals['failed']:5} "
        f"{totals['error']:5} {totals['skipped']:5}"
    )
    if show_causes:
        for file, row in summary.items():
            if row["causes"]:
                print(f"\n{file}: failures by cause")
                for cause, count in row["causes"].items():
                    print(f"  {count:4}  {cause}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Arguments after -- go to pytest."
    )
    parser.add_argument("tests_dir", type=Path, help="vLLM's tests/v1/core directory")
    parser.add_argument("--files", nargs="*", default=list(DEFAULT_FILES))
    parser.add_argument("--target", choices=("jaxkv", "vllm"), default="jaxkv")
    parser.add_argument("--python", default=sys.executable, help="interpreter running pytest")
    parser.add_argument("--json", type=Path, help="write per-test results here")
    parser.add_argument("--keep", type=Path, help="write the rewritten files here (kept)")
    parser.add_argument("--quiet", action="store_true", help="no per-cause breakdown")
    parser.add_argument(
        "--compare", type=Path, help="a --json file of a --target vllm run: pass counts on both"
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)

    sources = [args.tests_dir / name for name in args.files if (args.tests_dir / name).is_file()]
    if not sources:
        parser.error(f"none of {args.files} is in {args.tests_dir}")
    with tempfile.TemporaryDirectory(prefix="vllm-yardstick-") as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp) / "tests"
        workdir.mkdir(parents=True, exist_ok=True)
        for source in sources:
            rewritten = rewrite_imports(source.read_text(encoding="utf-8"))
            (workdir / source.name).write_text(rewritten, encoding="utf-8")
        shutil.copy(TOOLS_DIR / f"{SHIM_MODULE}.py", workdir / f"{SHIM_MODULE}.py")
        (workdir / "conftest.py").write_text(CONFTEST, encoding="utf-8")
        junit = Path(tmp) / "junit.xml"
        run_pytest(workdir, args.python, args.target, junit, pytest_args)
        if not junit.is_file():
            print("pytest wrote no report", file=sys.stderr)
            return 2
        results = parse_junit(junit)
    summary = summarise(results)
    print_summary(summary, args.target, show_causes=not args.quiet)
    comparison = None
    if args.compare:
        comparison = compare(results, json.loads(args.compare.read_text())["tests"])
        print(f"\n{'file':42} {'pass on baseline':>16} {'of those here':>13} {'only here':>9}")
        for file, row in comparison.items():
            print(
                f"{file:42} {row['pass_baseline']:16} {row['pass_both']:13} "
                f"{row['pass_only_here']:9}"
            )
    if args.json:
        payload = {"target": args.target, "summary": summary, "tests": results}
        if comparison is not None:
            payload["compare"] = comparison
        args.json.write_text(json.dumps(payload, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
