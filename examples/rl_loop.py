"""A GRPO-style training loop with jaxkv's engine as its sampler, end to end on a CPU.

What it does, every step:

1. Rollouts: `G` prompts (cycled from a fixed set), each sampled `n` times by
   `LLMEngine` (`SamplingParams(n=...)`, temperature 1, the sampled tokens' logprobs).
   The `n` samples of a prompt share its prefill: the prompt is computed about once,
   not `n` times (the printed "prompt computed" against "n x prompt").
2. Reward: the fraction of each sample's tokens in a target token set; the advantage is
   the reward normalised within its prompt's group (GRPO).
3. Trainer: the policy gradient of `-advantage * logprob(sample)` through the trainer's
   own forward pass, the very Flax NNX model the engine serves (`load_model` of a tiny
   random Llama checkpoint) run dense (`forward_dense`), optimised by optax's Adam. The
   trainer's logprobs of the sampled tokens are checked against the engine's (float32:
   within 1e-5): the sampler and the trainer compute the same distribution.
4. `engine.update_weights(state)`: the trainer's `nnx.State` is written into the engine's
   weight buffers in place, nothing recompiled; prompts seen under older weights never
   hit their stale KV blocks (weight-versioned block keys).

Printed per step: mean reward, prefix-hit rate, prompt tokens computed against
`n x prompt` (from `engine.stats`), programs compiled (0 after the first step, which
compiles the step shapes, the trainer's step and the weight write), rollout tokens/s.
`--plot FILE` draws reward and throughput per step.

Run: `python examples/rl_loop.py` (`--steps 30 --plot rl.png`).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxkv.device import compilation_count
from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.models import load_model, save_random_checkpoint, tiny_configs

# The toy task: sample tokens from this set (1/8 of the vocabulary; chance is 12.5%).
TARGET = range(128, 160)


@dataclass
class StepRecord:
    """One training step's figures (what `main` prints and returns)."""

    step: int
    reward: float
    prefix_hit_rate: float
    prompt_computed: int  # prompt tokens the engine computed this step
    prompt_total: int  # n x prompt, summed over the step's prompts
    compilations: int
    rollout_tokens_per_s: float
    logprob_error: float  # max |engine - trainer| logprob over the step's tokens


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (G)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=97)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="FILE", help="plot reward and throughput here")
    args = parser.parse_args(argv)
    for name in ("steps", "prompts", "n", "prompt_len", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def rewards(completions: np.ndarray) -> np.ndarray:
    """Per sample `[B]`: the fraction of its tokens `[B, T]` in `TARGET`."""
    return ((completions >= TARGET.start) & (completions < TARGET.stop)).mean(axis=1)


def group_advantages(reward: np.ndarray, n: int) -> np.ndarray:
    """GRPO: each reward less its group's mean, over its group's std (groups of `n`)."""
    groups = reward.reshape(-1, n)
    centred = groups - groups.mean(axis=1, keepdims=True)
    return (centred / (groups.std(axis=1, keepdims=True) + 1e-6)).reshape(-1)


class Trainer:
    """The policy: its own copy of the served model's state (the engine's buffers are
    donated to each weight write, so the trainer must own its arrays), Adam, one
    jitted step. `logprobs_and_step` returns the sampled tokens' logprobs under the
    current weights, then takes a gradient step."""

    def __init__(self, model: nnx.Module, lr: float, prompt_len: int) -> None:
        self.graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        # Copied through the host onto one device: the trainer's own buffers, placed as
        # its optimizer state and step outputs are (one compiled step for every call).
        device = jax.devices()[0]
        own = lambda tree: jax.tree.map(lambda x: jax.device_put(np.asarray(x), device), tree)  # noqa: E731
        self.params, self.rest = own(params), own(rest)
        self.optimizer = optax.adam(lr)
        self.opt_state = own(self.optimizer.init(self.params))  # committed, as outputs are
        self.prompt_len = prompt_len
        self._step = jax.jit(self._train_step)

    def state(self) -> nnx.State:
        """The full model state, as `LLMEngine.update_weights` takes it."""
        return nnx.merge_state(self.params, self.rest)

    def _logprobs(self, params, sequences: jax.Array) -> jax.Array:
        """`[B, T]`: each completion token's log probability given what precedes it."""
        model = nnx.merge(self.graphdef, params, self.rest)
        logits = jax.vmap(model.forward_dense)(sequences)
        logp = jax.nn.log_softmax(logits[:, self.prompt_len - 1 : -1], axis=-1)
        targets = sequences[:, self.prompt_len :]
        return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]

    def _train_step(self, params, opt_state, sequences, advantages):
        def loss(params):
            logp = self._logprobs(params, sequences)
            return -jnp.mean(advantages * logp.mean(axis=1)), logp

        (_, logp), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, logp

    def logprobs_and_step(self, sequences: np.ndarray, advantages: np.ndarray) -> np.ndarray:
        self.params, self.opt_state, logp = self._step(
            self.params, self.opt_state, jnp.asarray(sequences, jnp.int32),
            jnp.asarray(advantages, jnp.float32),
        )  # fmt: skip
        return np.asarray(logp)


def rollout(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams):
    """Sample every prompt `params.n` times: `(sequences [B, P+T], completion tokens
    [B, T], the engine's logprobs of them [B, T])`, prompt-major."""
    sequences, tokens, logprobs = [], [], []
    for prompt, output in zip(prompts, engine.generate(prompts, params), strict=True):
        for sample in sorted(output.outputs, key=lambda c: c.index):
            sequences.append(prompt + sample.token_ids)
            tokens.append(sample.token_ids)
            pairs = zip(sample.logprobs, sample.token_ids, strict=True)
            logprobs.append([position[token].logprob for position, token in pairs])
    return np.asarray(sequences), np.asarray(tokens), np.asarray(logprobs, np.float32)


def train(args: argparse.Namespace, engine: LLMEngine, trainer: Trainer) -> list[StepRecord]:
    rng = np.random.default_rng(args.seed)
    dataset = [rng.integers(3, TARGET.start, args.prompt_len).tolist() for _ in range(8)]
    params = SamplingParams(
        n=args.n, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0,
        seed=args.seed,
    )  # fmt: skip
    records = []
    for step in range(args.steps):
        first = step * args.prompts
        prompts = [dataset[(first + i) % len(dataset)] for i in range(args.prompts)]
        compiled, stats = compilation_count(), dict(engine.stats.totals)
        t0 = time.perf_counter()
        sequences, tokens, engine_logp = rollout(engine, prompts, params)
        rollout_s = time.perf_counter() - t0
        totals = engine.stats.totals
        delta = {k: totals[k] - stats[k] for k in totals}
        reward = rewards(tokens)
        trainer_logp = trainer.logprobs_and_step(sequences, group_advantages(reward, args.n))
        engine.update_weights(trainer.state())
        records.append(StepRecord(
            step, float(reward.mean()),
            delta["prefix_hits"] / max(1, delta["prefix_queries"]),
            # Every sample's last token is sampled, never fed back: the others were
            # scheduled as decode tokens, the rest of the scheduled tokens are prompt.
            int(delta["num_scheduled_tokens"] - delta["num_generated_tokens"] + len(tokens)),
            len(tokens) * args.prompt_len, compilation_count() - compiled,
            tokens.size / rollout_s, float(np.abs(trainer_logp - engine_logp).max()),
        ))  # fmt: skip
        print_record(records[-1])
    return records


def print_record(r: StepRecord) -> None:
    print(
        f"step {r.step:3d}  reward {r.reward:.3f}  prefix hits {r.prefix_hit_rate:.1%}  "
        f"prompt computed {r.prompt_computed:5d} / n x prompt {r.prompt_total:5d}  "
        f"compiled {r.compilations:2d}  rollout {r.rollout_tokens_per_s:7.0f} tok/s  "
        f"|logprob err| {r.logprob_error:.1e}",
        flush=True,
    )


def plot(records: list[StepRecord], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(6, 5))
    top.plot(steps, [r.reward for r in records], marker="o")
    top.set_ylabel("mean reward")
    bottom.plot(steps, [r.rollout_tokens_per_s for r in records], marker="o", color="C1")
    bottom.set_ylabel("rollout tokens/s")
    bottom.set_xlabel("training step")
    fig.suptitle("GRPO with jaxkv sampling")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[StepRecord]:
    args = parse_args(argv)
    block = 16
    with tempfile.TemporaryDirectory() as tmp:
        save_random_checkpoint(tmp, tiny_configs()["llama-tiny"], seed=args.seed)
        model = load_model(tmp)
    group = args.prompts * args.n
    max_len = args.prompt_len + args.max_tokens
    config = EngineConfig(
        block_size=block, num_blocks=4 * group * (-(-max_len // block)) + 1,
        max_num_seqs=group, max_num_batched_tokens=max(args.prompts * args.prompt_len, group),
        max_model_len=max_len,
    )  # fmt: skip
    engine = LLMEngine(model, config)
    trainer = Trainer(model, args.lr, args.prompt_len)
    records = train(args, engine, trainer)
    engine.shutdown()
    worst = max(r.logprob_error for r in records)
    print(f"engine vs trainer logprobs: max |error| {worst:.1e} (float32 tolerance 1e-5)")
    if args.plot:
        plot(records, args.plot)
        print(f"plot: {args.plot}")
    return records


if __name__ == "__main__":
    main()
