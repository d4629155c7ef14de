"""The serving engine: scheduler, model runner, sampling, `LLMEngine`.

Names load lazily: `jaxkv.engine.scheduler` (and `Scheduler` & co. from here) never
import JAX, so host-only benchmarks and tests can use the scheduler alone.
"""

from __future__ import annotations

from jaxkv._lazy import lazy_getattr

_EXPORTS = {
    "EngineConfig": "config",
    "LLMEngine": "engine",
    "choose_data_rank": "engine",
    "ModelRunner": "model_runner",
    "RowSampling": "request_rows",
    "KVCachePlan": "sizing",
    "plan_kv_cache": "sizing",
    "RequestOutput": "outputs",
    "RequestOutputKind": "sampling",
    "SamplingParams": "sampling",
    "sample_tokens": "sampling",
    "FinishReason": "scheduler",
    "TokenUpdates": "scheduler",
    "ScheduledRequest": "scheduler",
    "Scheduler": "scheduler",
    "SchedulerConfig": "scheduler",
    "SchedulerOutput": "scheduler",
    "EngineStats": "stats",
    "StepStats": "stats",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(
    "jaxkv.engine", {name: f"jaxkv.engine.{module}" for name, module in _EXPORTS.items()}, globals()
)
