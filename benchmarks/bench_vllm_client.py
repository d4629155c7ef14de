"""vLLM's own benchmark client against `jaxkv serve`: `vllm bench serve` (vLLM 0.33, in
the peer environment `.venv-vllm`; its `vllm` CLI needs vLLM's server packages, so its
module `vllm.benchmarks.serve` is run directly) with the backends `vllm`
(/v1/completions) and `openai-chat` (/v1/chat/completions) on its random dataset,
against a `jaxkv serve` subprocess. The official client must accept the server as it
is: every request completes (0 failed). The table is the client's own figures. Run:

    python -m benchmarks.bench_vllm_client [--checkpoint DIR] [--num-prompts 256]
        [--max-concurrency 32] [--input-len 128] [--output-len 64] [--record]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from benchmarks._common import PEER_VENV, add_record_option, print_table, results_name, write_json
from jaxkv.serving.process import ServeProcess

PEER_PYTHON = PEER_VENV / "bin" / "python"
BACKENDS = {"vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}
ENGINE_FLAGS = ("--num-blocks", "1536", "--max-num-seqs", "32",
                "--max-num-batched-tokens", "512", "--max-model-len", "512")  # fmt: skip
_PEER_MAIN = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
FIGURES = ("completed", "failed", "total_output_tokens", "median_ttft_ms", "p99_ttft_ms",
           "median_itl_ms", "p99_itl_ms", "median_tpot_ms", "output_throughput",
           "request_throughput")  # fmt: skip


def run_client(
    url: str, model: str, tokenizer: str, backend: str, num_prompts: int, concurrency: int,
    input_len: int, output_len: int, result_dir: str,
) -> dict:  # fmt: skip
    """One `vllm bench serve` run; its saved result (RuntimeError with its output when it
    fails)."""
    command = [
        str(PEER_PYTHON), "-c", _PEER_MAIN, "--backend", backend, "--endpoint", BACKENDS[backend],
        "--base-url", url, "--model", model, "--tokenizer", tokenizer,
        "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
        "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", "0", "--disable-tqdm",
        "--save-result", "--result-dir", result_dir, "--result-filename", f"{backend}.json",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    path = Path(result_dir) / f"{backend}.json"
    if done.returncode != 0 or not path.exists():
        raise RuntimeError(f"vllm bench serve ({backend}) failed:\n{done.stdout[-3000:]}"
                           f"\n{done.stderr[-3000:]}")  # fmt: skip
    return json.loads(path.read_text())


def measure(checkpoint: str, num_prompts: int, concurrency: int, input_len: int,
            output_len: int) -> dict[str, dict]:  # fmt: skip
    """Each backend's figures (`FIGURES`) against one `jaxkv serve` of `checkpoint`."""
    results = {}
    with (
        ServeProcess(checkpoint, *ENGINE_FLAGS, "--served-model-name", "tiny") as server,
        tempfile.TemporaryDirectory() as out,
    ):
        for backend in BACKENDS:
            result = run_client(server.url, "tiny", checkpoint, backend, num_prompts,
                                concurrency, input_len, output_len, out)  # fmt: skip
            results[backend] = {k: result[k] for k in FIGURES}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="servable checkpoint (default: a tiny one, now)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    add_record_option(parser)
    args = parser.parse_args()
    if not PEER_PYTHON.exists():
        print(f"{PEER_PYTHON} is missing (tools/vllm-peer-venv.sh builds it); nothing to run")
        return
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            from jaxkv.models.testing import save_chat_checkpoint

            checkpoint = str(save_chat_checkpoint(f"{tmp}/tiny"))
        results = measure(checkpoint, args.num_prompts, args.max_concurrency, args.input_len,
                          args.output_len)  # fmt: skip
    title = (f"vllm bench serve against jaxkv serve: random dataset, {args.num_prompts} "
             f"prompts of {args.input_len} tokens, {args.output_len} out, "
             f"{args.max_concurrency} at once")  # fmt: skip
    rows = [[backend, *(r[k] for k in FIGURES)] for backend, r in results.items()]
    print_table(title, ["backend", *FIGURES], rows)
    write_json(results_name("bench_vllm_client", parser, args), {"args": vars(args),
               "engine_flags": ENGINE_FLAGS, "results": results}, args.record)  # fmt: skip


if __name__ == "__main__":
    main()
