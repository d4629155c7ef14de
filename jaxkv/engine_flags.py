"""The command-line flags that size and build an engine, shared by `jaxkv generate` and
`jaxkv serve`: their parser (`add_engine_arguments`), their checks before anything
loads (`check_engine_flags`: one `ValueError` naming the flag), and the engine they ask
for (`load_engine`, `mesh_for`)."""

from __future__ import annotations

import argparse

from jaxkv._checks import check_host_memory, parse_memory
from jaxkv.sampling_params import LOGPROBS_MODES

__all__ = [
    "add_engine_arguments", "check_engine_flags", "check_positive", "load_engine", "mesh_for",
]  # fmt: skip

DEFAULT_MEMORY_UTILIZATION = 0.9
DEFAULT_KV_CACHE_MEMORY = 2**30


def check_positive(args: argparse.Namespace, *flags: str) -> None:
    """ValueError naming the first of `flags` (e.g. "--max-model-len") given a value < 1."""
    for flag in flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value}")


def _memory_settings(args: argparse.Namespace, mesh) -> dict:
    """The EngineConfig fields that size the KV cache, from the flags (module defaults)."""
    if args.num_blocks is not None:
        return {"num_blocks": args.num_blocks}
    if args.kv_cache_memory is not None:
        return {"kv_cache_memory": parse_memory(args.kv_cache_memory, "--kv-cache-memory")}
    utilization = args.gpu_memory_utilization
    if utilization is not None:
        if not 0 < utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
        return {"memory_utilization": utilization}
    import jax

    device = jax.local_devices()[0]  # the mesh's devices are all of one kind
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return {"memory_utilization": DEFAULT_MEMORY_UTILIZATION}
    return {"kv_cache_memory": DEFAULT_KV_CACHE_MEMORY}


def _offloading_settings(args: argparse.Namespace) -> dict:
    """The EngineConfig field of `--kv-offloading-size` (the host tier is off without it)."""
    if args.kv_offloading_size is None:
        return {}
    size = parse_memory(args.kv_offloading_size, "--kv-offloading-size")
    check_host_memory("--kv-offloading-size", size)
    return {"kv_offloading_size": size}


# The EngineConfig fields of the `--kv-events-*` bounds (each flag is the field's name).
_KV_EVENTS_BOUNDS = (
    "kv_events_hwm", "kv_events_buffer_steps", "kv_events_max_queue_size", "kv_events_replay_hwm",
)  # fmt: skip


def _kv_events_settings(args: argparse.Namespace) -> dict:
    """The EngineConfig fields of the `--kv-events-*` flags (publishing is off without
    `--kv-events-endpoint`)."""
    check_positive(args, *("--" + field.replace("_", "-") for field in _KV_EVENTS_BOUNDS))
    bounds = {f: getattr(args, f) for f in _KV_EVENTS_BOUNDS if getattr(args, f) is not None}
    if args.kv_events_endpoint is None:
        if (
            args.kv_events_replay_endpoint is not None
            or args.kv_events_topic
            or args.kv_events_redact_prompts
            or bounds
        ):
            raise ValueError(
                "--kv-events-replay-endpoint, --kv-events-topic, --kv-events-redact-prompts "
                "and the --kv-events-* bounds need --kv-events-endpoint"
            )
        return {}
    from jaxkv.kv_events_publisher import check_endpoint

    # Before the model loads: a bad port or a taken ipc path fails at once.
    check_endpoint(args.kv_events_endpoint, "--kv-events-endpoint")
    if args.kv_events_replay_endpoint is not None:
        check_endpoint(args.kv_events_replay_endpoint, "--kv-events-replay-endpoint")
    return {
        "kv_events_endpoint": args.kv_events_endpoint,
        "kv_events_replay_endpoint": args.kv_events_replay_endpoint,
        "kv_events_topic": args.kv_events_topic,
        "kv_events_redact_prompts": args.kv_events_redact_prompts,
        **bounds,
    }


def add_kv_events_arguments(p: argparse.ArgumentParser) -> None:
    """The `--kv-events-*` flags of the serving commands (vLLM's wire)."""
    p.add_argument(
        "--kv-events-endpoint", metavar="ADDR",
        help="publish KV cache events on this ZeroMQ address, e.g. tcp://*:5557 (binds for "
        "*, :: and ipc/inproc, connects otherwise; data rank k uses the port + k); off by "
        "default",
    )  # fmt: skip
    p.add_argument(
        "--kv-events-replay-endpoint", metavar="ADDR",
        help="ZeroMQ ROUTER address answering replay requests, e.g. tcp://*:5558",
    )  # fmt: skip
    p.add_argument("--kv-events-topic", default="", help="topic frame of every event message")
    p.add_argument(
        "--kv-events-redact-prompts", action="store_true",
        help="publish BlockStored without token ids and extra keys (prompts, cache salts); "
        "block hashes still route",
    )  # fmt: skip
    bounds = {
        "hwm": "messages queued for each subscriber that does not read (the PUB socket's "
        "high-water mark; default 100000)",
        "buffer-steps": "messages kept for replay (default 10000)",
        "max-queue-size": "batches waiting to be sent; past it the oldest is dropped "
        "(default 100000)",
        "replay-hwm": "replayed messages queued for each replay client; one that does not "
        "read is dropped (default 1000)",
    }
    for name, help_text in bounds.items():
        p.add_argument(f"--kv-events-{name}", type=int, metavar="N", help=help_text)


def check_engine_flags(args: argparse.Namespace) -> dict:
    """The engine flags' own checks (`add_engine_arguments`), before anything loads; the
    EngineConfig fields of the `--kv-events-*` flags."""
    check_positive(
        args, "--max-model-len", "--max-num-batched-tokens", "--num-blocks", "--max-num-seqs",
        "--tensor-parallel-size", "--data-parallel-size",
    )  # fmt: skip
    return _kv_events_settings(args)


def load_engine(args: argparse.Namespace, tokenizer, mesh, kv_events: dict):
    """The engine the engine flags ask for, on `mesh`, and its model (weights read last:
    a bad size is reported before)."""
    from jaxkv import models
    from jaxkv.device.compilation_cache import enable_compilation_cache
    from jaxkv.engine import EngineConfig, LLMEngine

    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, logprobs_mode=args.logprobs_mode,
        compilation_cache_dir=args.compilation_cache, **_memory_settings(args, mesh),
        **kv_events, **_offloading_settings(args),
    )  # fmt: skip
    enable_compilation_cache(args.compilation_cache)  # loading compiles programs too
    scan_layers = {"auto": None, "on": True, "off": False}[args.scan_layers]
    model = models.load_model(args.model, dtype=args.dtype, mesh=mesh, scan_layers=scan_layers)
    return LLMEngine(model, config, tokenizer=tokenizer, mesh=mesh), model


def mesh_for(data: int, model: int, distributed=None):
    """The `(data, model)` mesh over the first `data * model` devices (None: one device).
    Over several processes it must take every process's devices (all of them)."""
    import jax

    devices = jax.devices()
    if distributed is not None and data * model != len(devices):
        raise ValueError(
            f"--data-parallel-size {data} x --tensor-parallel-size {model} must be the "
            f"{len(devices)} devices of the {distributed.num_processes} processes: each process "
            "drives its own devices"
        )
    if data == model == 1:
        return None
    from jaxkv.device import make_mesh

    if data * model > len(devices):
        raise ValueError(
            f"--data-parallel-size {data} x --tensor-parallel-size {model} needs "
            f"{data * model} devices; {len(devices)} available"
        )
    return make_mesh(data, model, devices[: data * model])


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that size and build the engine (`generate` and `serve` take them)."""
    p.add_argument(
        "--max-model-len", type=int,
        help="default: the longest request the KV cache holds, at most the checkpoint's",
    )  # fmt: skip
    p.add_argument(
        "--kv-cache-memory", metavar="SIZE",
        help="KV-cache bytes per device, e.g. 4GiB (default: 90%% of a device that reports "
        "its memory, else 1GiB)",
    )  # fmt: skip
    p.add_argument("--gpu-memory-utilization", type=float, help="share of device memory, (0, 1]")
    p.add_argument(
        "--kv-offloading-size", metavar="SIZE",
        help="host memory for a KV tier behind the device pool (vLLM's name), e.g. 8GiB: "
        "evicted prefixes are loaded back instead of recomputed (default: off)",
    )  # fmt: skip
    p.add_argument("--num-blocks", type=int, help="KV blocks (instead of a memory budget)")
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"])
    p.add_argument(
        "--logprobs-mode", default=LOGPROBS_MODES[0], choices=LOGPROBS_MODES,
        help="what logprobs hold (vLLM's): log-probabilities or logits of the raw model "
        "output, or of what the token was sampled from after penalties and filters",
    )  # fmt: skip
    p.add_argument(
        "--scan-layers", choices=("auto", "on", "off"), default="auto",
        help="one scanned layer body (on CPU, decode copies each layer's weights) or one "
        "stack per layer, run a few layers per program ('auto': scan off CPU)",
    )  # fmt: skip
    p.add_argument(
        "--compilation-cache", default="auto", metavar="DIR",
        help="XLA's persistent compilation cache ('auto': $JAXKV_COMPILATION_CACHE or "
        "~/.cache/jaxkv/xla; 'none': off)",
    )  # fmt: skip
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1,
        help="devices on the mesh's model axis (attention heads, MLP units split over them)",
    )  # fmt: skip
    p.add_argument(
        "--data-parallel-size", type=int, default=1,
        help="devices on the mesh's data axis (requests spread over them)",
    )  # fmt: skip

    add_kv_events_arguments(p)
