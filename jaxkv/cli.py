"""The `jaxkv` command: `demo`, `generate`, `plan`, `serve` (also `python -m jaxkv`).

Bad input (a flag, a file, a checkpoint) is one line on stderr, `jaxkv: error: ...`,
naming the flag or file, and exit status 2, as argparse reports its own errors; other
exceptions are bugs and keep their traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from jaxkv._checks import parse_memory
from jaxkv.engine_flags import (
    add_engine_arguments,
    check_engine_flags,
    check_positive,
    load_engine,
    mesh_for,
)
from jaxkv.prompts_file import read_prompts

__all__ = ["main"]


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(
            f"--prompt-token-ids {text!r} must be comma-separated integers, e.g. 1,2,3"
        ) from None
    if not ids:
        raise ValueError("--prompt-token-ids is empty: give at least one token id")
    return ids


def cmd_demo(args: argparse.Namespace) -> int:
    from jaxkv import demo

    summaries = demo.run(args)
    return 0 if all(s["dense_check"] == "OK" for s in summaries) else 1


# Without --num-blocks, --kv-cache-memory or --gpu-memory-utilization: this share of a
# device that reports its memory, else this many bytes (CPU).


def add_distributed_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of one engine over several processes (`jax.distributed`; default: one)."""
    address_help = (
        "run as one of --num-processes processes of one engine; process 0 serves this address, "
        "takes the prompts and prints (default: $JAX_COORDINATOR_ADDRESS, else one process)"
    )
    p.add_argument("--coordinator-address", metavar="HOST:PORT", help=address_help)
    p.add_argument("--num-processes", type=int, help="processes (default: $JAX_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, help="this process, 0.. (default: $JAX_PROCESS_ID)")
    p.add_argument(
        "--distributed-timeout", type=float, metavar="SECONDS",
        help="a process that does not join, or dies, ends the others with an error after this "
        "(default: 20)",
    )  # fmt: skip


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxkv.models.prompting import PromptEncoder

    check_positive(args, "--max-tokens")
    kv_events = check_engine_flags(args)
    try:
        from jaxkv import models
    except ImportError as error:  # pragma: no cover - the models package ships with jaxkv
        raise SystemExit(f"jaxkv generate needs jaxkv.models: {error}") from None
    distributed = _join(args)
    mesh = mesh_for(args.data_parallel_size, args.tensor_parallel_size, distributed)
    # The small inputs first, so that a bad one is reported before the weights are read.
    tokenizer = models.load_tokenizer(args.model)
    texts = [(args.prompt, None)] if args.prompt is not None else None
    if args.prompts is not None:
        texts = read_prompts(args.prompts)
    if texts is not None and tokenizer is None:
        raise ValueError(
            f"text prompts need {args.model}/tokenizer.json; give --prompt-token-ids instead"
        )
    if args.chat and texts is None:
        raise ValueError("--chat needs --prompt or --prompts (text to put in the template)")
    if texts is not None:
        encoder = PromptEncoder.from_dir(args.model, tokenizer)
        # With --chat the template places the image when it takes content parts.
        parts = 1 if args.image else 0
        prompts = [encoder.encode(text, chat=args.chat, images=parts) for text, _ in texts]
        max_tokens = [n or args.max_tokens for _, n in texts]
    else:
        prompts, max_tokens = [_token_ids(args.prompt_token_ids)], [args.max_tokens]
    images = [_load_image(args.model, args.image)] if args.image else None
    if images and len(prompts) > 1:
        raise ValueError("--image goes with one prompt (--prompt or --prompt-token-ids)")
    engine, model = load_engine(args, tokenizer, mesh, kv_events)
    if images:
        image_token_id = getattr(model.config, "image_token_id", None)
        if image_token_id is not None and image_token_id not in prompts[0]:
            prompts[0] = [image_token_id] + prompts[0]  # the image goes before the text
    try:
        if distributed and distributed.process_id != 0:
            engine.follow()  # process 0 takes the requests and prints the outputs
            status = 0
        else:
            status = _serve(engine, args, prompts, max_tokens, images)
    finally:
        engine.shutdown()
    if distributed:  # all processes got here: leave the job together
        from jaxkv.engine import multihost

        multihost.shutdown()
    return status


def _distributed_config(args: argparse.Namespace):
    """The job's `DistributedConfig` from the flags (or the environment), None for one
    process; ValueError naming a bad flag."""
    from jaxkv.engine.distributed_config import DistributedConfig

    timeout = {} if args.distributed_timeout is None else {"timeout_s": args.distributed_timeout}
    return DistributedConfig.resolve(
        args.coordinator_address, args.num_processes, args.process_id, **timeout
    )


def _supervise(args: argparse.Namespace, argv: list[str]) -> int | None:
    """`jaxkv generate` over several processes runs in a worker process that this one
    supervises (`jaxkv.engine.supervisor`: the runtime's aborts become the engine's
    error); its exit status, or None to run the command here (one process, or this is
    the worker). Process 0 checks first that it can serve the coordinator's port."""
    if args.func is not cmd_generate:
        return None
    from jaxkv.engine import supervisor
    from jaxkv.engine.distributed_config import check_port_free

    if supervisor.in_worker():
        supervisor.die_with_supervisor()
        return None
    distributed = _distributed_config(args)
    if distributed is None:
        return None
    if distributed.process_id == 0:
        check_port_free(distributed.bind_address)
    return supervisor.supervise(argv, distributed)


def _join(args: argparse.Namespace):
    """`--coordinator-address` (or `JAX_COORDINATOR_ADDRESS`...): join the job, then refuse
    to go on unless every process got the same flags, checkpoint and jaxkv version. The
    job's `DistributedConfig`, or None for one process."""
    from importlib.metadata import version

    from jaxkv.engine import multihost
    from jaxkv.models.checkpoint import checkpoint_index

    distributed = _distributed_config(args)
    if distributed is None:
        return None
    multihost.initialize(distributed)
    settings = {"jaxkv version": version("jaxkv"), "checkpoint index": checkpoint_index(args.model)}
    for name, value in sorted(vars(args).items()):
        if name not in ("func", "process_id", "coordinator_address"):
            settings["--" + name.replace("_", "-")] = repr(value)
    multihost.check_same_everywhere(settings, "settings")
    return distributed


def _serve(engine, args: argparse.Namespace, prompts, max_tokens, images) -> int:
    """`jaxkv generate`'s serving part: generate, print the outputs."""
    import time

    from jaxkv.engine import SamplingParams

    print(engine.kv_cache_sizing.describe(), file=sys.stderr)
    sampling = [
        SamplingParams(
            max_tokens=n,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )  # fmt: skip
        for n in max_tokens
    ]
    start = time.perf_counter()
    outputs = engine.generate(
        prompts, sampling, images=[images] + [None] * (len(prompts) - 1),
        cache_salt=args.cache_salt,
    )  # fmt: skip
    elapsed = time.perf_counter() - start
    errors = [o.error for o in outputs if o.error and o.finish_reason is None]
    if errors and len(outputs) == 1:
        raise ValueError(errors[0])
    for out in outputs:
        if args.json:
            print(json.dumps({
                "prompt_token_ids": out.prompt_token_ids,
                "output_token_ids": out.output_token_ids,
                "text": out.text,
                "finish_reason": out.finish_reason,
                "num_cached_tokens": out.num_cached_tokens,
                "num_host_cached_tokens": out.num_host_cached_tokens,
                "error": out.error,
            }))  # fmt: skip
        elif out.error:
            print(f"error: {out.error}")
        else:
            print(out.text if out.text is not None else " ".join(map(str, out.output_token_ids)))
    if args.prompts is not None:
        generated = sum(len(o.output_token_ids) for o in outputs)
        print(
            f"{len(outputs)} prompts, {generated} tokens in {elapsed:.2f} s: "
            f"{generated / elapsed:.1f} tokens/s; prefix-cache hits "
            f"{engine.stats.prefix_hit_rate:.0%}"
            + (f", host-tier hits {engine.stats.host_hit_rate:.0%}" if engine.offload else ""),
            file=sys.stderr,
        )
    return 0


def _load_image(model_dir: str, image_path: str):
    """The image as pixel values `[C, H, W]`, preprocessed as the checkpoint says."""
    from jaxkv.models.image import PREPROCESSOR_CONFIG, image_pixels, load_preprocessor_config

    config = load_preprocessor_config(model_dir)
    if config is None:
        path = Path(model_dir) / PREPROCESSOR_CONFIG
        raise ValueError(f"--image needs {path} (how to preprocess images)")
    return image_pixels(image_path, config)


def read_kv_cache_specs(model_dir: str, block_size: int, dtype: str) -> dict:
    """`{layer: KVCacheSpec}` of the checkpoint's decoder, from `config.json` alone."""
    from types import SimpleNamespace

    from jaxkv.models.base import CausalLM
    from jaxkv.models.checkpoint import read_config
    from jaxkv.models.config import LlavaConfig, parse_model_config

    config = parse_model_config(read_config(model_dir), f"{Path(model_dir) / 'config.json'}")
    decoder = config.text if isinstance(config, LlavaConfig) else config
    # The specs follow from the decoder config only: no weights are read.
    return CausalLM.kv_cache_specs(SimpleNamespace(config=decoder), block_size, dtype)


def capacity_plan(specs: dict, engine, tp: int = 1) -> dict:
    """Blocks, token capacity, concurrency and bytes per device of the KV-cache plan the
    engine would make (`jaxkv.engine.sizing.plan_kv_cache`, on this process's first
    device) for layers `specs` and the `EngineConfig` `engine`; with `tp` > 1 the bytes
    per device of the layers' heads split `tp` ways (and those replicated)."""
    from jaxkv.engine.sizing import plan_kv_cache
    from jaxkv.kv_cache_planning import get_kv_cache_capacity, kv_cache_per_device_bytes

    plan = plan_kv_cache(specs, engine, None)
    config, max_model_len = plan.kv_cache_config, plan.max_model_len
    capacity = get_kv_cache_capacity(config, max_model_len, engine.max_num_batched_tokens)
    per_device, replicated = (
        kv_cache_per_device_bytes(specs, plan.num_blocks, tp)
        if tp > 1
        else (plan.num_blocks * plan.bytes_per_block, 0)
    )
    return {
        "num_blocks": plan.num_blocks,
        "groups": [
            {
                "layers": len(g.layer_names),
                "spec": type(g.kv_cache_spec).__name__,
                "block_size": g.kv_cache_spec.block_size,
                "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None),
            }
            for g in config.kv_cache_groups
        ],  # fmt: skip
        "max_model_len": max_model_len,
        "token_capacity": capacity.num_tokens,
        "max_concurrency": capacity.max_concurrency,
        "bytes_per_device": per_device,
        "replicated_bytes": replicated,
    }


def format_plan(plan: dict) -> str:
    lines = [f"KV cache blocks: {plan['num_blocks']}"]
    for i, g in enumerate(plan["groups"]):
        window = f", window {g['sliding_window']}" if g["sliding_window"] else ""
        lines.append(
            f"  group {i}: {g['layers']} layers, {g['spec']}, block size {g['block_size']}{window}"
        )
    lines.append(f"token capacity: {plan['token_capacity']}")
    lines.append(
        f"max concurrency at {plan['max_model_len']} tokens: {plan['max_concurrency']:.2f}x"
    )
    lines.append(f"bytes per device: {plan['bytes_per_device']:,}")
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    check_positive(
        args, "--max-model-len", "--max-num-batched-tokens", "--block-size",
        "--tensor-parallel-size", "--max-num-seqs",
    )  # fmt: skip
    memory = None if args.memory is None else parse_memory(args.memory)
    if args.topology:
        return _topology_plan(args, memory)
    if memory is None:
        raise ValueError("--memory is needed (it defaults to the chip's HBM only with --topology)")
    if args.mesh:
        return _pod_plan(args, memory)
    if args.aot:
        raise ValueError("--aot compiles the step on a mesh: give --mesh DATAxMODEL or --topology")
    import jax

    from jaxkv.device.attention import default_block_size
    from jaxkv.engine.config import EngineConfig

    engine = EngineConfig(
        block_size=args.block_size or default_block_size(jax.default_backend()),
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        kv_cache_memory=memory, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    specs = read_kv_cache_specs(args.model, engine.block_size, args.dtype)
    plan = capacity_plan(specs, engine, args.tensor_parallel_size)
    print(json.dumps(plan) if args.json else format_plan(plan))
    return 0


def _topology_plan(args: argparse.Namespace, memory: int | None) -> int:
    """`jaxkv plan --topology v6e:4x4 --aot ...` (or `h100`, `a100:8`): the engine's programs
    compiled by the TPU or CUDA compiler for each slice or set of GPUs, per chip
    (`jaxkv.engine.topology_plan`)."""
    from jaxkv.engine.pod_plan import parse_mesh

    if not args.aot:
        raise ValueError("--topology compiles for the TPU or GPUs it names: add --aot")
    if len(args.mesh or []) > 1:
        raise ValueError("--topology takes at most one --mesh DATAxMODEL (its model axis)")
    model_axis = parse_mesh(args.mesh[0])[1] if args.mesh else None
    from jaxkv.device.attention import default_block_size
    from jaxkv.device.gpu_targets import parse_gpu_topology
    from jaxkv.engine.config import EngineConfig
    from jaxkv.engine.topology_plan import format_topology_plan, plan_topology
    from jaxkv.models.checkpoint import read_config
    from jaxkv.models.config import parse_model_config

    config = parse_model_config(read_config(args.model), f"{Path(args.model) / 'config.json'}")
    for topology in args.topology:
        platform = "gpu" if parse_gpu_topology(topology) else "tpu"
        engine = EngineConfig(
            block_size=args.block_size or default_block_size(platform),
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
        )  # fmt: skip
        plan = plan_topology(config, topology, engine, memory=memory, model_axis=model_axis)
        print(json.dumps(plan.as_dict()) if args.json else format_topology_plan(plan), flush=True)
    return 0


def _pod_plan(args: argparse.Namespace, memory: int) -> int:
    """`jaxkv plan --mesh DATAxMODEL ...`: per-device weights, KV cache and (`--aot`) the
    compiled steps' memory on each mesh (`jaxkv.engine.pod_plan`)."""
    from jaxkv.engine.pod_plan import parse_mesh

    if args.tensor_parallel_size != 1:
        raise ValueError("--tensor-parallel-size goes without --mesh: MODEL of --mesh is it")
    for text in args.mesh:
        parse_mesh(text)  # bad text is reported before JAX starts
    from jaxkv.device.attention import default_block_size
    from jaxkv.engine.pod_plan import format_plans, plan_mesh, pod_mesh
    from jaxkv.models.checkpoint import read_config
    from jaxkv.models.config import parse_model_config

    meshes = [pod_mesh(text) for text in args.mesh]
    config = parse_model_config(read_config(args.model), f"{Path(args.model) / 'config.json'}")
    plans = []
    for mesh in meshes:
        plans.append(
            plan_mesh(
                config,
                mesh,
                kv_cache_memory=memory,
                max_model_len=args.max_model_len,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs,
                block_size=args.block_size or default_block_size(mesh.devices.flat[0].platform),
                dtype=args.dtype,
                kv_cache_dtype=args.kv_cache_dtype,
                aot=args.aot,
            )  # fmt: skip
        )
        if args.json:
            print(json.dumps(plans[-1].as_dict()), flush=True)
    if not args.json:
        print(format_plans(plans))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxkv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    from jaxkv import demo

    p = sub.add_parser("demo", help="serve a mixed workload on tiny built-in models")
    demo.add_arguments(p)
    p.set_defaults(func=cmd_demo)
    _add_generate_parser(sub)
    _add_plan_parser(sub)
    from jaxkv.serving.command import add_serve_parser

    add_serve_parser(sub)
    return parser


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate from a local Hugging Face checkpoint")
    p.add_argument("--model", required=True, help="checkpoint directory")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="text (needs tokenizer.json beside the checkpoint)")
    group.add_argument("--prompt-token-ids", help="comma-separated token ids, e.g. 1,2,3")
    group.add_argument(
        "--prompts", metavar="FILE",
        help='one prompt a line, or JSONL {"prompt": ..., "max_tokens": N}: served as one '
        "batch with prefix caching; prints tokens/s",
    )  # fmt: skip
    p.add_argument("--chat", action="store_true", help="apply the checkpoint's chat template")
    p.add_argument("--image", help="a PNG/JPEG, preprocessed as preprocessor_config.json says")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--cache-salt", help="tenant key: prefix-cache blocks are shared only within it")
    add_engine_arguments(p)
    p.add_argument("--json", action="store_true", help="print prompt and output token ids")
    add_distributed_arguments(p)
    p.set_defaults(func=cmd_generate)


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="KV-cache capacity plan for a checkpoint")
    p.add_argument("--model", required=True, help="checkpoint directory (config.json)")
    p.add_argument(
        "--memory",
        help="KV-cache memory per device, e.g. 16GiB (with --topology: default the chip's HBM "
        "less weights, compiled programs and a 5%% reserve)",
    )
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--block-size", type=int,
        help="tokens per KV block (default: 128 for a TPU, else 16)",
    )  # fmt: skip
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument(
        "--mesh", action="append", metavar="DATAxMODEL",
        help="plan serving on this (data, model) mesh over all devices, e.g. 16x16 "
        "(repeatable; on CPU simulate devices with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=N): per-device weights and KV cache",
    )  # fmt: skip
    p.add_argument(
        "--topology", action="append", metavar="NAME",
        help="with --aot: compile for this TPU slice or these GPUs without them, e.g. "
        "v5e:2x2, v6e:4x4 (needs jax[tpu]), h100, h200:8, a100 (needs jax-cuda13-plugin); "
        "repeatable; --mesh then sets only the model axis",
    )  # fmt: skip
    p.add_argument(
        "--aot", action="store_true",
        help="with --mesh: compile one decode and one prefill step on abstract inputs and "
        "report their memory per device",
    )  # fmt: skip
    p.add_argument(
        "--max-num-seqs", type=int, default=64,
        help="with --mesh: requests per data rank (the decode step's batch)",
    )  # fmt: skip
    p.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
        help="the KV cache's storage (auto: --dtype)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="JSON (with --mesh: one object a mesh)")
    p.set_defaults(func=cmd_plan)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        status = _supervise(args, argv)
        return args.func(args) if status is None else status
    except (ValueError, OSError) as error:  # bad input; anything else is a bug
        print(f"jaxkv: error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # a process of the job missing or configured differently
        multihost = sys.modules.get("jaxkv.engine.multihost")
        if multihost is None or not isinstance(error, multihost.DistributedError):
            raise
        multihost.exit_now(error)  # status 1, without waiting on the lost process


if __name__ == "__main__":
    sys.exit(main())
