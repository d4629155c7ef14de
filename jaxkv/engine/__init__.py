"""The serving engine: scheduler, model runner, sampling, `LLMEngine` (imports JAX).

`jaxkv.engine.scheduler` alone is host-only (no JAX), for host benchmarks and tests.
"""

from jaxkv.engine.engine import EngineConfig, LLMEngine
from jaxkv.engine.model_runner import ModelRunner, RowSampling, group_kv_cache_specs
from jaxkv.engine.outputs import RequestOutput
from jaxkv.engine.sampling import SamplingParams, sample_tokens
from jaxkv.engine.scheduler import (
    FinishReason,
    RequestUpdate,
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from jaxkv.engine.stats import EngineStats, StepStats

__all__ = [
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "LLMEngine",
    "ModelRunner",
    "RequestOutput",
    "RequestUpdate",
    "RowSampling",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StepStats",
    "group_kv_cache_specs",
    "sample_tokens",
]
