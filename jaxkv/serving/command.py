"""`jaxkv serve --model DIR [engine flags] --host 127.0.0.1 --port 8000`: the OpenAI API
over one engine, which runs in a process of its own (several engines: run one server
each and route in front, `examples/kv_aware_routing.py`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_serve_parser"]


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from jaxkv.engine_flags import add_engine_arguments

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (vLLM's endpoints)")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--served-model-name", help="the model's name in the API (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--max-pending-requests", type=int, default=1024, metavar="N",
        help="requests admitted at once (running and waiting); past it the server answers "
        "503 with Retry-After",
    )  # fmt: skip
    p.add_argument(
        "--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
        help="on SIGTERM, time in-flight requests get to finish before they are aborted",
    )  # fmt: skip
    add_engine_arguments(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from jaxkv import engine_flags, models
    from jaxkv.engine.distributed_config import check_port_free
    from jaxkv.models.prompting import PromptEncoder
    from jaxkv.serving.app import ServedModel
    from jaxkv.serving.engine_process import EngineProcess
    from jaxkv.serving.images import ServedImages
    from jaxkv.serving.server import Server

    engine_flags.check_engine_flags(args)
    if args.max_pending_requests < 1:
        raise ValueError(f"--max-pending-requests must be >= 1, got {args.max_pending_requests}")
    if not 0 <= args.shutdown_grace <= 86400:
        raise ValueError(
            f"--shutdown-grace must be in [0, 86400] seconds, got {args.shutdown_grace}"
        )
    host = f"[{args.host}]" if ":" in args.host else args.host
    check_port_free(f"{host}:{args.port}", "--host/--port")
    tokenizer = models.load_tokenizer(args.model)
    encoder = None if tokenizer is None else PromptEncoder.from_dir(args.model, tokenizer)
    images = ServedImages.from_dir(args.model, tokenizer)
    engine = EngineProcess(build_engine, args)
    name = args.served_model_name or str(Path(args.model))
    served = ServedModel(name, engine.info["max_model_len"], tokenizer, encoder, images)
    server = Server(
        engine, served, host=args.host, port=args.port,
        max_pending=args.max_pending_requests, grace_s=args.shutdown_grace,
    )  # fmt: skip
    print(f"jaxkv serve: {name} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    return server.run()


def build_engine(args: argparse.Namespace) -> tuple[object, dict]:
    """In the engine's process: the engine the flags ask for, every step shape compiled
    (a compile in the first requests' steps would stall every stream then: seconds of
    TTFT under load), and what the server needs to know of it."""
    from jaxkv import engine_flags, models

    kv_events = engine_flags.check_engine_flags(args)
    mesh = engine_flags.mesh_for(args.data_parallel_size, args.tensor_parallel_size)
    engine, _ = engine_flags.load_engine(args, models.load_tokenizer(args.model), mesh, kv_events)
    engine.warm_up()
    return engine, {"max_model_len": engine.config.max_model_len}
