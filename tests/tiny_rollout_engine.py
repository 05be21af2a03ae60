"""A rollout engine of one's own, named by import path (``rollout.engine=tiny_rollout_engine:
WrappedHfEngine``): it wraps the ``hf`` engine and counts its calls. tests/
test_engine_conformance.py runs it through the GRPO workflow's config validation and the
rollout role's builder; the tests directory is on the path of the driver and of Ray workers.

:class:`NoPause` misses the protocol's ``pause`` and ``resume``: refused with their names.
"""

from __future__ import annotations

from m2flow.workers.rollout.engines import HfEngine


class WrappedHfEngine:
    """The ``hf`` engine behind a wrapper (what a caching or logging layer would look like)."""

    needs_model, generates, block_steps = True, True, False

    @classmethod
    def build(cls, args: dict, model, tokenizer) -> WrappedHfEngine:
        return cls(HfEngine.build(args, model, tokenizer))

    @classmethod
    def check(cls, config: dict, world_size: int | None = None, role: str = "rollout") -> None:
        if config.get("n_samples", 2) > 64:
            raise ValueError(f"{role}.n_samples={config['n_samples']}: this engine takes <= 64")

    def __init__(self, inner: HfEngine) -> None:
        self.inner, self.calls = inner, 0

    @property
    def model(self):
        return self.inner.model

    @property
    def version(self) -> int:
        return self.inner.version

    def generate(self, prompt_ids, n_samples, max_new_tokens, sample_keys) -> dict:
        self.calls += 1
        return self.inner.generate(prompt_ids, n_samples, max_new_tokens, sample_keys)

    def update_weights(self, version: int, weights=None) -> None:
        self.inner.update_weights(version, weights)

    def pause(self) -> None:
        self.inner.pause()

    def resume(self) -> None:
        self.inner.resume()

    def sleep(self) -> bool:
        return self.inner.sleep()

    def wake_up(self) -> bool:
        return self.inner.wake_up()


class NoPause(WrappedHfEngine):
    """Misses ``pause`` and ``resume`` (set to ``None``: not callable)."""

    pause = None
    resume = None
