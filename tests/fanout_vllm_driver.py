"""vLLM 0.33's `n > 1` fan-out on the host, for `test_fanout_vllm_diff.py`.

Run under `.venv-vllm/bin/python` (vLLM, no model): reads cases as JSON on stdin,
writes results as JSON on stdout. Each case adds one parent request through vLLM's own
`LLMEngine.add_request` (its `ParentRequest` fan-out; the engine core a recorder), then
plays its events through vLLM's `OutputProcessor`: `["step", [[child, [tokens],
finish_reason or None], ...]]` (the children's engine-core outputs of one step),
`["abort_parent"]` (`LLMEngine.abort_request([parent])`) and `["abort_child", i]`
(child `i` aborted by its internal id). An abort's final outputs are the ones vLLM puts
on a request's queue (AsyncLLM's); the sync engine's abort returns none.

Per case: the children vLLM made (`[id, n, seed]`) and, per event, its outputs as
`[request_id, finished, [[index, token_ids, finish_reason, stop_reason], ...]]`.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"] = "1"  # ids as jaxkv gives them

from vllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason  # noqa: E402
from vllm.v1.engine.input_processor import InputProcessor  # noqa: E402
from vllm.v1.engine.llm_engine import LLMEngine  # noqa: E402
from vllm.v1.engine.output_processor import OutputProcessor  # noqa: E402

REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


class _Core:
    """The engine core: records the requests added and aborted."""

    def __init__(self) -> None:
        self.added: list[EngineCoreRequest] = []

    def add_request(self, request: EngineCoreRequest) -> None:
        self.added.append(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        pass


class _Inputs:
    assign_request_id = staticmethod(InputProcessor.assign_request_id)

    def apply_watermarking(self, params, watermarking) -> None:
        pass

    def resolve_watermarking(self, params):
        return None


class _Engine:
    """What `LLMEngine.add_request` and `abort_request` use of an engine."""

    def __init__(self) -> None:
        self.input_processor = _Inputs()
        self.output_processor = OutputProcessor(tokenizer=None, log_stats=False)
        self.engine_core = _Core()


class _Queue:
    """A request's output queue, held only while an abort runs: what vLLM puts there."""

    def __init__(self) -> None:
        self.items: list = []

    def put(self, item) -> None:
        self.items.append(item)


def summary(output) -> list:
    completions = [
        [c.index, list(c.token_ids), c.finish_reason, c.stop_reason] for c in output.outputs
    ]
    return [output.request_id, output.finished, completions]


def abort(engine: _Engine, request_ids: list[str], internal: bool) -> list:
    """Abort, returning the outputs vLLM puts on the aborted children's queues."""
    queue = _Queue()
    for state in engine.output_processor.request_states.values():
        state.queue = queue
    LLMEngine.abort_request(engine, request_ids, internal=internal)
    for state in engine.output_processor.request_states.values():
        state.queue = None
    return queue.items


def run_case(case: dict) -> dict:
    engine = _Engine()
    params = SamplingParams(
        n=case["n"], temperature=1.0, seed=case["seed"], max_tokens=64,
        output_kind=RequestOutputKind[case["kind"]],
    )  # fmt: skip
    request = EngineCoreRequest(
        request_id=case["parent"], prompt_token_ids=list(case["prompt"]), mm_features=None,
        sampling_params=params, pooling_params=None, arrival_time=time.time(),
        lora_request=None, cache_salt=None, data_parallel_rank=None,
    )  # fmt: skip
    LLMEngine.add_request(engine, case["parent"], request, params)
    children = [r.request_id for r in engine.engine_core.added]
    outputs = []
    for event in case["events"]:
        if event[0] == "step":
            core = [
                EngineCoreOutput(
                    request_id=children[child],
                    new_token_ids=tokens,
                    finish_reason=None if reason is None else REASONS[reason],
                )  # fmt: skip
                for child, tokens, reason in event[1]
            ]
            made = engine.output_processor.process_outputs(core).request_outputs
        elif event[0] == "abort_parent":
            made = abort(engine, [case["parent"]], internal=False)
        else:
            made = abort(engine, [children[event[1]]], internal=True)
        outputs.append([summary(o) for o in made])
    added = [[r.request_id, r.sampling_params.n, r.sampling_params.seed]
             for r in engine.engine_core.added]  # fmt: skip
    return {"children": added, "outputs": outputs}


def main() -> None:
    json.dump([run_case(case) for case in json.load(sys.stdin)], sys.stdout)


if __name__ == "__main__":
    main()
