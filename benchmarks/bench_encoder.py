"""Encoder cache benchmark: a LLaVA-like multimodal request stream.

Requests carry several images drawn from a Zipf-popular catalogue, 576
embeddings each (LLaVA-1.5's 24x24 patch grid). A scheduler-like loop admits
requests FIFO, looks every image up in the encoder cache
(`check_and_update_cache`), allocates misses under a per-step encoder compute
budget (`can_allocate` / `allocate`), runs each fully scheduled request for a
few decode steps, then `free`s it, and drains `get_freed_mm_hashes()` every
step.

Two timings per manager:

* `scheduler loop`: the loop above, end to end (its own Python overhead included);
* `manager ops`: the exact call sequence the loop made, replayed as a flat list
  of calls, so the time is (almost) only the manager's.

`--peer vllm` runs the identical stream through vLLM's `EncoderCacheManager` in
the same process and checks that every hit, allocation decision and freed hash
is identical before reporting the speed ratio.

`--store` measures the device side instead (`EncoderCacheStore`, needs JAX): 400
items of random sizes (1 to 1024 embeddings, half handed over as JAX arrays, half
as NumPy) are put, read back and evicted, once the way the store worked before
issue 12 (a bf16 buffer, JAX inputs padded on device and results cut on device:
programs per item size) and once as it works now (uint16 bits on CPU, page-bucket
programs only). Each run is a fresh process; runs alternate; the table gives the
median and range of programs compiled, resident memory added and seconds, and
their ratios.

    .venv/bin/python -m benchmarks.bench_encoder [--peer vllm] [--requests 4000]
    .venv/bin/python -m benchmarks.bench_encoder --store [--store-items 400]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from benchmarks._common import (
    REPO_ROOT,
    add_record_option,
    ensure_peer_process,
    print_table,
    results_name,
    write_json,
)
from jaxkv.encoder_cache_manager import EncoderCacheManager
from jaxkv.request import MultiModalFeatureSpec, Request

EMBEDS_PER_IMAGE = 576
TEXT_TOKENS = 32


def make_requests(
    num_requests: int, num_images: int, max_images_per_request: int, zipf_a: float, seed: int
) -> list[Request]:
    """Requests with 1..max_images_per_request images each, image ids Zipf-distributed."""
    rng = np.random.default_rng(seed)
    requests = []
    for r in range(num_requests):
        count = int(rng.integers(1, max_images_per_request + 1))
        image_ids = (rng.zipf(zipf_a, size=count) - 1) % num_images
        features = []
        offset = TEXT_TOKENS
        for image_id in image_ids:
            features.append(MultiModalFeatureSpec(f"img-{image_id}", offset, EMBEDS_PER_IMAGE))
            offset += EMBEDS_PER_IMAGE + TEXT_TOKENS
        requests.append(Request(f"req-{r}", np.zeros(offset, dtype=np.int64), mm_features=features))
    return requests


def run_scheduler(
    manager: object,
    requests: list[Request],
    *,
    compute_budget: int,
    max_running: int,
    arrivals_per_step: int,
    decode_steps: int,
) -> tuple[list[tuple], list[tuple[str, tuple]]]:
    """Drive `manager` like a scheduler; return (decision trace, flat call list)."""
    check = manager.check_and_update_cache
    can_allocate = manager.can_allocate
    allocate = manager.allocate
    free = manager.free
    get_freed = manager.get_freed_mm_hashes
    trace: list[tuple] = []
    calls: list[tuple[str, tuple]] = []
    pending = deque(requests)
    waiting: deque[list] = deque()  # [request, next input id]
    running: deque[tuple[int, Request]] = deque()  # (finish step, request)
    step = 0
    while pending or waiting or running:
        for _ in range(min(arrivals_per_step, len(pending))):
            waiting.append([pending.popleft(), 0])
        budget = compute_budget
        scheduled = 0
        while waiting and len(running) < max_running:
            entry = waiting[0]
            request, input_id = entry
            num_inputs = len(request.mm_features)
            while input_id < num_inputs:
                calls.append(("check", (request, input_id)))
                if check(request, input_id):
                    trace.append(("hit", request.request_id, input_id))
                    input_id += 1
                    continue
                calls.append(("can", (request, input_id, budget, scheduled)))
                if not can_allocate(request, input_id, budget, scheduled):
                    trace.append(("blocked", request.request_id, input_id))
                    break
                calls.append(("alloc", (request, input_id)))
                allocate(request, input_id)
                trace.append(("miss", request.request_id, input_id))
                budget -= EMBEDS_PER_IMAGE
                scheduled += EMBEDS_PER_IMAGE
                input_id += 1
            entry[1] = input_id
            if input_id < num_inputs:
                break  # FIFO: nobody overtakes a blocked request
            waiting.popleft()
            running.append((step + decode_steps, request))
        while running and running[0][0] <= step:
            request = running.popleft()[1]
            calls.append(("free", (request,)))
            free(request)
        calls.append(("freed", ()))
        freed = get_freed()
        if freed:
            trace.append(("freed", tuple(freed)))
        step += 1
    return trace, calls


def replay_seconds(factory: Callable[[], object], calls: list[tuple[str, tuple]]) -> float:
    """Seconds to issue `calls` against a fresh manager, the calls bound beforehand."""
    manager = factory()
    methods: dict[str, Callable] = {
        "check": manager.check_and_update_cache,
        "can": manager.can_allocate,
        "alloc": manager.allocate,
        "free": manager.free,
        "freed": manager.get_freed_mm_hashes,
    }
    bound = [(methods[name], args) for name, args in calls]
    start = time.thread_time()
    for method, args in bound:
        method(*args)
    return time.thread_time() - start


def measure(
    factories: dict[str, Callable[[int], object]],
    requests: list[Request],
    args: argparse.Namespace,
) -> list[dict]:
    """Time every manager on the stream; repeats alternate between managers so
    that background load on a shared machine hits them alike."""
    cache_size = args.cache_images * EMBEDS_PER_IMAGE
    knobs = dict(
        compute_budget=args.budget_images * EMBEDS_PER_IMAGE,
        max_running=args.max_running,
        arrivals_per_step=args.arrivals_per_step,
        decode_steps=args.decode_steps,
    )
    loop_s = dict.fromkeys(factories, float("inf"))
    ops_s = dict.fromkeys(factories, float("inf"))
    runs: dict[str, tuple[list[tuple], list[tuple[str, tuple]]]] = {}
    for _ in range(args.repeats):
        for name, factory in factories.items():
            start = time.thread_time()
            runs[name] = run_scheduler(factory(cache_size), requests, **knobs)
            loop_s[name] = min(loop_s[name], time.thread_time() - start)
            seconds = replay_seconds(lambda factory=factory: factory(cache_size), runs[name][1])
            ops_s[name] = min(ops_s[name], seconds)
    results = []
    for name, (trace, calls) in runs.items():
        hits = sum(1 for t in trace if t[0] == "hit")
        misses = sum(1 for t in trace if t[0] == "miss")
        results.append(
            {
                "name": name,
                "trace": trace,
                "num_calls": len(calls),
                "hit_rate": hits / (hits + misses),
                "hits": hits,
                "misses": misses,
                "evicted": sum(len(t[1]) for t in trace if t[0] == "freed"),
                "loop_s": loop_s[name],
                "ops_s": ops_s[name],
                "ops_per_s": len(calls) / ops_s[name],
                "loop_ops_per_s": len(calls) / loop_s[name],
            }
        )
    return results


STORE_VARIANTS = ("before", "after")


def _resident_bytes() -> int:
    """This process's resident set size (Linux `/proc/self/status`)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def store_run(variant: str, items: int, seed: int) -> dict:
    """One fresh-process run of the device store stream (see the module docstring).

    "before" reproduces the store's pre-issue-12 behaviour through its own
    programs: the bf16 buffer as such, JAX inputs padded with `jnp.pad` and results
    cut with a slice on device, each a program per item size.
    """
    import jax
    import jax.numpy as jnp

    from jaxkv.device import compilation_count
    from jaxkv.device.encoder_store import EncoderCacheStore, _bucket
    from jaxkv.device.host_inputs import pad_to_bucket
    from jaxkv.encoder_pages import EncoderPageAllocator

    page_size, hidden, max_embeds = 16, 2048, 1024
    num_pages = 8 * max_embeds // page_size
    storage = "bfloat16" if variant == "before" else "auto"
    store = EncoderCacheStore(
        num_pages, page_size, hidden, dtype=jnp.bfloat16, storage_dtype=storage
    )
    allocator = EncoderPageAllocator(num_pages, page_size)
    array = store.allocate()
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, max_embeds + 1, size=items)
    data = [rng.standard_normal((int(n), hidden)).astype(jnp.bfloat16) for n in sizes]
    jax.block_until_ready(array)
    pointer = array.unsafe_buffer_pointer()
    resident, programs = _resident_bytes(), compilation_count()
    start = time.perf_counter()
    live: list[str] = []
    for i, x in enumerate(data):
        embeds = jax.device_put(x) if i % 2 else x  # jnp.asarray would compile per shape
        n, mm_hash = x.shape[0], f"item{i}"
        while allocator.num_free_pages * page_size < n:
            allocator.free([live.pop(0)])
        pages = allocator.allocate(mm_hash, n)
        if variant == "before":
            bucket = _bucket(len(pages))
            pad = ((0, bucket * page_size - n), (0, 0))
            values = np.pad(embeds, pad) if isinstance(embeds, np.ndarray) else jnp.pad(embeds, pad)
            padded = pad_to_bucket(pages, bucket, num_pages)
            array = store._write(array, padded, values)
            out = store.gather_padded(array, pages)[:n]
        else:
            array = store.write(array, embeds, pages)
            out = store.gather(array, pages, n)
        live.append(mm_hash)
        jax.block_until_ready(out)
    seconds = time.perf_counter() - start
    return {
        "variant": variant,
        "programs": compilation_count() - programs,
        "resident_mib": (_resident_bytes() - resident) / 2**20,
        "seconds": seconds,
        "storage_dtype": str(store.storage_dtype),
        "store_mib": store.nbytes / 2**20,
        "buffer_kept": array.unsafe_buffer_pointer() == pointer,
        "distinct_sizes": len(set(sizes.tolist())),
    }


def bench_store(items: int, rounds: int, seed: int) -> dict:
    """`rounds` alternating fresh-process runs of each variant; median, range, ratios."""
    from tqdm import tqdm

    runs: dict[str, list[dict]] = {v: [] for v in STORE_VARIANTS}
    with tqdm(total=rounds * len(STORE_VARIANTS), desc="encoder store runs") as bar:
        for r in range(rounds):
            order = STORE_VARIANTS if r % 2 == 0 else STORE_VARIANTS[::-1]
            for variant in order:
                code = (
                    "import json, sys; from benchmarks.bench_encoder import store_run; "
                    "print('RUN' + json.dumps(store_run(sys.argv[1], int(sys.argv[2]), "
                    "int(sys.argv[3]))))"
                )
                proc = subprocess.run(
                    [sys.executable, "-c", code, variant, str(items), str(seed)],
                    cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                )  # fmt: skip
                line = next(x for x in proc.stdout.splitlines() if x.startswith("RUN"))
                runs[variant].append(json.loads(line[3:]))
                bar.update()
    summary = {}
    for variant, rows in runs.items():
        summary[variant] = {
            key: {
                "median": statistics.median(row[key] for row in rows),
                "min": min(row[key] for row in rows),
                "max": max(row[key] for row in rows),
            }
            for key in ("programs", "resident_mib", "seconds")
        }
        summary[variant].update(
            {k: rows[0][k] for k in ("storage_dtype", "store_mib", "distinct_sizes")}
        )
        summary[variant]["buffer_kept"] = all(row["buffer_kept"] for row in rows)
    ratios = {
        key: summary["before"][key]["median"] / max(summary["after"][key]["median"], 1e-9)
        for key in ("programs", "resident_mib", "seconds")
    }
    return {"items": items, "rounds": rounds, "runs": runs, "summary": summary, "ratios": ratios}


def report_store(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    result = bench_store(args.store_items, args.repeats, args.seed)
    rows = []
    for variant, row in result["summary"].items():
        cells = [variant, row["storage_dtype"], "yes" if row["buffer_kept"] else "no"]
        for key, fmt in (("programs", "{:.0f}"), ("resident_mib", "{:.0f}"), ("seconds", "{:.2f}")):
            m = row[key]
            cells.append(
                f"{fmt.format(m['median'])} [{fmt.format(m['min'])}, {fmt.format(m['max'])}]"
            )
        rows.append(cells)
    ratios = result["ratios"]
    rows.append(
        ["before / after", "", ""]
        + [f"{ratios[k]:.1f}x" for k in ("programs", "resident_mib", "seconds")]
    )
    summary = result["summary"]["after"]
    print_table(
        f"encoder store: {args.store_items} items of random size ({summary['distinct_sizes']} "
        f"distinct), store {summary['store_mib']:.0f} MiB bf16, {args.repeats} runs each "
        "(median [min, max])",
        ["store", "storage", "buffer kept", "programs", "resident MiB", "seconds"],
        rows,
    )
    write_json(results_name("bench_encoder", parser, args), result, record=args.record)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", choices=["vllm"], default=None)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--images", type=int, default=3000, help="catalogue size")
    parser.add_argument("--max-images-per-request", type=int, default=4)
    parser.add_argument("--zipf", type=float, default=1.2)
    parser.add_argument("--cache-images", type=int, default=48, help="cache size in images")
    parser.add_argument("--budget-images", type=int, default=6, help="encoder budget per step")
    parser.add_argument("--max-running", type=int, default=8)
    parser.add_argument("--arrivals-per-step", type=int, default=2)
    parser.add_argument("--decode-steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--store", action="store_true", help="measure the device EncoderCacheStore instead"
    )
    parser.add_argument("--store-items", type=int, default=400)
    add_record_option(parser)
    args = parser.parse_args()
    if args.store:
        report_store(args, parser)
        return

    peer = args.peer == "vllm" and ensure_peer_process()
    requests = make_requests(
        args.requests, args.images, args.max_images_per_request, args.zipf, args.seed
    )
    factories: dict[str, Callable[[int], object]] = {"jaxkv": EncoderCacheManager}
    if peer:
        from vllm.v1.core.encoder_cache_manager import EncoderCacheManager as VllmManager

        factories["vllm"] = VllmManager
    results = measure(factories, requests, args)
    if peer:
        if results[0]["trace"] != results[1]["trace"]:
            raise SystemExit("FAIL: jaxkv and vLLM made different hit/evict decisions")
        print(f"[peer] identical decisions over {len(results[0]['trace'])} trace events")

    rows = [
        [
            r["name"],
            r["num_calls"],
            f"{r['hit_rate']:.3f}",
            r["evicted"],
            f"{r['ops_per_s'] / 1e6:.3f}",
            f"{r['loop_ops_per_s'] / 1e6:.3f}",
        ]
        for r in results
    ]
    header = ["manager", "calls", "hit rate", "evicted", "Mops/s (ops)", "Mops/s (loop)"]
    print_table(
        f"encoder cache: {args.requests} requests, {EMBEDS_PER_IMAGE} embeds/image, "
        f"cache {args.cache_images} images, Zipf a={args.zipf}",
        header,
        rows,
    )
    repeated = sum(
        len({f.identifier for f in r.mm_features}) < len(r.mm_features) for r in requests
    )
    print(f"{repeated} of {len(requests)} requests carry the same image more than once")
    payload = {
        "config": vars(args),
        "requests_with_repeated_image": repeated,
        "results": [{k: v for k, v in r.items() if k != "trace"} for r in results],
    }
    if peer:
        ops_ratio = results[1]["ops_s"] / results[0]["ops_s"]
        loop_ratio = results[1]["loop_s"] / results[0]["loop_s"]
        payload["speedup_vs_vllm"] = {"manager_ops": ops_ratio, "scheduler_loop": loop_ratio}
        payload["identical_decisions"] = True
        print(
            f"speed vs vLLM: {ops_ratio:.2f}x (manager ops), {loop_ratio:.2f}x (scheduler loop); "
            "target >= 1.5x"
        )
    write_json(results_name("bench_encoder", parser, args), payload, record=args.record)


if __name__ == "__main__":
    main()
