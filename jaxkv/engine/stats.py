"""Per-step engine statistics and their running totals."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

from jaxkv._checks import DEFAULT_TENANT_QUOTA_KEY
from jaxkv.host_tier import HostTierStats
from jaxkv.host_tier import TenantStats as HostTenantStats


@dataclass
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


@dataclass
class EngineStats:
    """Totals over every step since the engine started, and per cache
    salt (`by_salt[None]`: requests without a salt) the prefix-cache use of its requests;
    `tenants()` adds each salt's figures in the device pool and the host tier."""

    steps: list[StepStats] = field(default_factory=list)
    by_salt: dict[str | None, TenantStats] = field(default_factory=dict)
    tier_snapshot: TierSnapshot | None = field(default=None, repr=False, compare=False)

    def record(self, step: StepStats) -> None:
        self.steps.append(step)

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
        return sum(getattr(s, name) for s in self.steps)

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
        """Totals of every counter, plus the hit rates."""
        out: dict[str, float] = {"steps": len(self.steps)}
        for f in fields(StepStats):
            if f.name not in ("step", "kv_usage", "num_running", "num_waiting", "num_loading"):
                out[f.name] = self.total(f.name)
        out["prefix_hit_rate"] = self.prefix_hit_rate
        out["encoder_hit_rate"] = self.encoder_hit_rate
        out["host_hit_rate"] = self.host_hit_rate
        out["max_kv_usage"] = max((s.kv_usage for s in self.steps), default=0.0)
        return out
