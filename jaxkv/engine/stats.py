"""Per-step engine statistics: running totals over the whole run and a bounded window of
the most recent steps (as vLLM's stat loggers keep intervals, not every step), so a
server that never stops holds a fixed amount of them."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from jaxkv._checks import DEFAULT_TENANT_QUOTA_KEY, check_int
from jaxkv.host_tier import HostTierStats
from jaxkv.host_tier import TenantStats as HostTenantStats


@dataclass(slots=True)
class StepStats:
    """One `LLMEngine.step()`.

    `host_s`: time the host spent scheduling, packing, dispatching and applying outputs;
    `wait_s`: time it blocked on device results (with overlap, the part of the device
    step the host work did not hide). `compilations`: XLA programs compiled in the step.
    """

    step: int
    num_scheduled_tokens: int = 0
    num_scheduled_requests: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_loading: int = 0  # admitted, waiting for their host-tier loads
    num_generated_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    encoder_hits: int = 0
    encoder_misses: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    num_freed_blocks: int = 0
    host_s: float = 0.0
    wait_s: float = 0.0
    compilations: int = 0
    # Host tier: tokens looked up after the device prefix hit, found (verified), bytes
    # loaded and stored, loads that failed (verification or staging; recomputed).
    host_queried_tokens: int = 0
    host_hit_tokens: int = 0
    host_loaded_bytes: int = 0
    host_stored_bytes: int = 0
    host_failed_loads: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def encoder_hit_rate(self) -> float:
        total = self.encoder_hits + self.encoder_misses
        return self.encoder_hits / total if total else 0.0


@dataclass
class TenantStats:
    """Prefix-cache use of the requests of one cache salt, counted at first admission:
    `cached_tokens` from either tier, `host_cached_tokens` those the host tier served."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class TenantTiers:
    """One cache salt in both tiers, now (`EngineStats.tenants()`).

    `prefix`: its requests' prefix-cache use. `device_cached_blocks`: blocks it holds in
    the device prefix cache, all data ranks (None: not counted, with
    `EngineConfig.device_tenant_block_quotas` None, and for unsalted requests);
    `device_block_quota`: its cap per
    data rank (None: none). `host`: its use of the host tier (bytes used and quota,
    blocks stored and evicted, verification mismatches; None: no host tier)."""

    prefix: TenantStats
    device_cached_blocks: int | None
    device_block_quota: int | None
    host: HostTenantStats | None


# What the engine reports of its tiers for `EngineStats.tenants`: device cached blocks
# per salt (None: not counted), device caps (None: off), the host tier's stats (None: off).
TierSnapshot = Callable[
    [], tuple[dict[str, int] | None, dict[str, int] | None, HostTierStats | None]
]


# The `StepStats` fields kept as running totals (`EngineStats.total`): all but the step's
# number; `summary()` leaves out the gauges too (their sum means nothing).
_TOTALLED = tuple(f.name for f in fields(StepStats) if f.name != "step")
_GAUGES = ("kv_usage", "num_running", "num_waiting", "num_loading")
DEFAULT_WINDOW_STEPS = 10_000


@dataclass
class EngineStats:
    """Totals over every step since the engine started, the last `window_steps` steps
    themselves (`steps`, oldest first), and per cache salt (`by_salt[None]`: requests
    without a salt) the prefix-cache use of its requests; `tenants()` adds each salt's
    figures in the device pool and the host tier.

    Invariants: `num_steps` counts every step recorded; `totals[name]` is the sum of
    field `name` over all of them (added in order, so the same float `sum()` over a list
    of every step gives); `steps` holds the last `min(num_steps, window_steps)` of them;
    memory and `summary()`'s cost do not grow with the run's length."""

    window_steps: int = DEFAULT_WINDOW_STEPS
    steps: deque[StepStats] = field(init=False)
    num_steps: int = field(default=0, init=False)
    totals: dict[str, float] = field(init=False)
    max_kv_usage: float = field(default=0.0, init=False)
    by_salt: dict[str | None, TenantStats] = field(default_factory=dict)
    tier_snapshot: TierSnapshot | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.window_steps = check_int("EngineStats.window_steps", self.window_steps, min_value=1)
        self.steps = deque(maxlen=self.window_steps)
        self.totals = dict.fromkeys(_TOTALLED, 0)

    def record(self, step: StepStats) -> None:
        self.steps.append(step)
        self.num_steps += 1
        totals = self.totals
        for name in _TOTALLED:
            totals[name] += getattr(step, name)
        self.max_kv_usage = max(self.max_kv_usage, step.kv_usage)

    def steps_since(self, step: int) -> list[StepStats]:
        """The recorded steps numbered `step` or later (`StepStats.step`, the engine's
        `num_steps` when it ran), oldest first; ValueError when the window no longer
        holds all of them."""
        kept = self.steps
        first = kept[0].step if kept else self.num_steps
        if step < first and self.num_steps > len(kept):
            raise ValueError(
                f"steps from {step} on are not all kept: the window holds the last "
                f"{self.window_steps} steps (from {first}); raise "
                "EngineConfig.stats_window_steps to keep more"
            )
        return [s for s in kept if s.step >= step]

    def record_admission(
        self, salt: str | None, prompt_tokens: int, cached_tokens: int, host_cached_tokens: int = 0
    ) -> None:
        tenant = self.by_salt.setdefault(salt, TenantStats())
        tenant.requests += 1
        tenant.prompt_tokens += prompt_tokens
        tenant.cached_tokens += cached_tokens
        tenant.host_cached_tokens += host_cached_tokens

    def tenants(self) -> dict[str | None, TenantTiers]:
        """Per cache salt (None: no salt), every salt seen by either tier or admitted."""
        device, caps, host = self.tier_snapshot() if self.tier_snapshot else (None, None, None)
        salts = dict.fromkeys(self.by_salt)
        salts.update(dict.fromkeys(device or ()))
        salts.update(dict.fromkeys(host.tenants if host is not None else ()))
        out = {}
        for salt in salts:
            host_tenant = None
            if host is not None:
                host_tenant = host.tenants.get(salt) or HostTenantStats(quota_bytes=None)
            counted = device is not None and salt is not None  # unsalted blocks are not
            out[salt] = TenantTiers(
                prefix=self.by_salt.get(salt) or TenantStats(),
                device_cached_blocks=device.get(salt, 0) if counted else None,  # type: ignore[union-attr, arg-type]
                device_block_quota=None
                if caps is None or salt is None
                else caps.get(salt, caps.get(DEFAULT_TENANT_QUOTA_KEY)),
                host=host_tenant,
            )
        return out

    def total(self, name: str) -> float:
        """Field `name` of `StepStats` summed over every step recorded."""
        try:
            return self.totals[name]
        except KeyError:
            raise ValueError(
                f"no running total named {name!r}; totals are kept of {', '.join(_TOTALLED)}"
            ) from None

    @property
    def prefix_hit_rate(self) -> float:
        queries = self.total("prefix_queries")
        return self.total("prefix_hits") / queries if queries else 0.0

    @property
    def host_hit_rate(self) -> float:
        """Tokens the host tier served over those looked up in it."""
        queried = self.total("host_queried_tokens")
        return self.total("host_hit_tokens") / queried if queried else 0.0

    @property
    def encoder_hit_rate(self) -> float:
        total = self.total("encoder_hits") + self.total("encoder_misses")
        return self.total("encoder_hits") / total if total else 0.0

    def summary(self) -> dict[str, float]:
        """Totals of every counter over the whole run, plus the hit rates and the highest
        KV usage; from the running totals (its cost does not grow with the run)."""
        out: dict[str, float] = {"steps": self.num_steps}
        for name in _TOTALLED:
            if name not in _GAUGES:
                out[name] = self.totals[name]
        out["prefix_hit_rate"] = self.prefix_hit_rate
        out["encoder_hit_rate"] = self.encoder_hit_rate
        out["host_hit_rate"] = self.host_hit_rate
        out["max_kv_usage"] = self.max_kv_usage
        return out
