"""Settings of the spot rollout pool (``rollout.spot`` in the LLM workflows)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EmulatedEngineConfig:
    """``rollout.spot.emulated``: the emulated engine (``rollout.spot.engine=emulated``;
    :mod:`m2flow.workers.rollout.emulated`, docs/results/emulation.md)."""

    model: str = "qwen3-8b"  # throughput preset: qwen3-8b | qwen3-14b | qwen3-32b (TP 2, H100)
    time_scale: float = 1.0  # emulated seconds per real second (as cluster.spot.time_scale)
    length_median: float = 3000.0  # response tokens: lognormal median ...
    length_sigma: float = 1.0  # ... and log-space std; capped at rollout.max_new_tokens
    length_cap: int = 16384  # and at this
    prompt_tokens: int = 0  # modelled prompt length (0: the real prompt's)
    mem_util: float = 0.0  # HBM share for weights + KV cache (0: the preset's)


@dataclass
class SpotPoolConfig:
    """The spot rollout pool (RLBoost; docs/results/spot.md). Off unless ``enabled``.

    Times in seconds; counts of requests (responses) unless said otherwise. ``N_prem``, the
    most spot instances held (Algorithm 1): starts at ``n_prem_init`` (else ``N_resv``), is
    set by line 10 after every step, then capped at the step's request count, clamped to
    ``[n_prem_min, n_prem_max]`` (``n_prem_max`` 0: no upper clamp); ``n_prem_min`` wins a
    conflict. ``seed_share``: :func:`m2flow.scheduler.spot.seeding_share` ("fair") or the
    ablation "all" (a reserved rank leases up to ``max_batch`` while it seeds).
    """

    enabled: bool = False  # on: rollout also runs on spot instances (or a plan turns it on)
    t_seed_init: float = 1.0  # Algorithm 1's T_init: the reserved ranks' first seeding window
    eta: float = 3.0  # Algorithm 1's adaptation rate (T_seed moves by wait difference / eta)
    memory: bool = True  # Algorithm 1's scheduler memory M (ablation: False)
    seeding: bool = True  # ablation False: no seeding (T_seed 0; line 10 still sets N_prem)
    # a seeding reserved rank holds at most its share of the step's requests, ceil(requests /
    # (N_resv + spot instances expected)), the rest queued for spot instances as they become
    # current ("fair"); or up to max_batch ("all": the old rule, an ablation)
    seed_share: str = "fair"
    # most spot instances the pool holds: a cap on Algorithm 1's N_prem (line 10), e.g. a
    # budget, applied after the cap at the step's request count (0: no cap of its own)
    n_prem_max: int = 0
    n_prem_min: int = 1  # floor under N_prem (>= 1: the pool never turns itself off)
    n_prem_init: int = 0  # Algorithm 1's first N_prem (0: line 3's N_resv; a plan sets it)
    theta: int = 8  # Algorithm 2's Θ: most pending requests per instance (delayed dispatch)
    dispatch: str = "jsq"  # "jsq" (Algorithm 2) or "round_robin" (ablation)
    rebalance: bool = True  # Algorithm 2's continuous rebalancing (ablation: False)
    block_tokens: int = 4  # tokens per report: a preemption loses at most one block
    max_batch: int = 64  # requests an instance executes at once
    batch_rows: int = 32  # rows of every engine forward (fixed: exact tokens; docs/results/spot.md)
    micro_batch_prompts: int = 4  # m_b: GRPO groups per chunk streamed to training
    threads: int = 1  # torch threads of a spot instance
    migration: str = "tokens"  # "tokens": keep the partial response; "recompute" (ablation)
    min_new_tokens: int = 0  # EOS is not sampled before this many tokens (vLLM's min_tokens)
    # exact engine: seconds added to each decode iteration (one token for every executing
    # request), a slower device's pace on a tiny model; tokens and logprobs do not change
    decode_delay_s: float = 0.0
    timeout_s: float = 1800.0  # longest wait for a step's responses
    # a dead instance whose node is marked dead within this many seconds was preempted, else it
    # crashed (m2flow.core.liveness.preempted; Ray marks a lost node dead in ~15 s by default)
    preempt_grace_s: float = 30.0
    # the spot instances' engine: a rollout backend that continues requests block by block
    # (block_steps): "exact" (ExactEngine), "emulated" (sleeps by a throughput model), "vllm",
    # a registered one or an import path (m2flow.workers.engines.registry)
    engine: str = "exact"
    emulated: EmulatedEngineConfig = field(default_factory=EmulatedEngineConfig)

    def __post_init__(self) -> None:
        if isinstance(self.emulated, dict):  # from asdict()/a plain config section
            self.emulated = EmulatedEngineConfig(**self.emulated)

    def check(self) -> None:
        """Raises ValueError naming the first bad value."""
        bad = [
            (self.t_seed_init >= 0, "rollout.spot.t_seed_init must be >= 0"),
            (self.eta > 0, "rollout.spot.eta must be > 0"),
            (self.theta >= 1, "rollout.spot.theta must be >= 1"),
            (self.dispatch in ("jsq", "round_robin"), "rollout.spot.dispatch: jsq|round_robin"),
            (self.seed_share in ("fair", "all"), "rollout.spot.seed_share: fair|all"),
            (self.block_tokens >= 1, "rollout.spot.block_tokens must be >= 1"),
            (self.max_batch >= 1 and self.batch_rows >= 1, "max_batch, batch_rows must be >= 1"),
            (self.micro_batch_prompts >= 1, "rollout.spot.micro_batch_prompts must be >= 1"),
            (self.n_prem_max >= 0, "rollout.spot.n_prem_max must be >= 0"),
            (self.n_prem_min >= 1, "rollout.spot.n_prem_min must be >= 1"),
            (self.n_prem_init >= 0, "rollout.spot.n_prem_init must be >= 0"),
            (self.migration in ("tokens", "recompute"), "rollout.spot.migration: tokens|recompute"),
            (self.min_new_tokens >= 0, "rollout.spot.min_new_tokens must be >= 0"),
            (0 <= self.decode_delay_s < 60, "rollout.spot.decode_delay_s must be in [0, 60)"),
            (self.preempt_grace_s >= 0, "rollout.spot.preempt_grace_s must be >= 0"),
        ]
        e = self.emulated
        if self.engine == "emulated":
            from ..emulated import PRESETS

            bad += [
                (e.model.lower() in PRESETS, f"rollout.spot.emulated.model: {'|'.join(PRESETS)}"),
                (e.time_scale > 0, "rollout.spot.emulated.time_scale must be > 0"),
                (e.length_median > 0 and e.length_sigma >= 0 and e.length_cap >= 1,
                 "rollout.spot.emulated: length_median > 0, length_sigma >= 0, length_cap >= 1"),
                (e.prompt_tokens >= 0, "rollout.spot.emulated.prompt_tokens must be >= 0"),
                (0 <= e.mem_util <= 1, "rollout.spot.emulated.mem_util must be in [0, 1]"),
            ]  # fmt: skip
        for ok, msg in bad:
            if not ok:
                raise ValueError(msg)
        self.check_engine()

    def check_engine(self) -> type:
        """The spot instances' engine class, asked of the registry: one that continues
        requests block by block (its ``block_steps``), as an instance drives it. Returns it.

        Raises:
            ValueError: an unknown engine, or one that cannot serve spot instances (named, with
                the engines that can).
            EngineProtocolError: the class misses members of the rollout protocol.
        """
        from ...engines.registry import choices, engine_class, names

        cls = engine_class("rollout", self.engine, "rollout.spot")
        if not getattr(cls, "block_steps", False):
            able = [n for n in names("rollout") if _serves_spot(n)]
            raise ValueError(
                f"rollout.spot.engine={self.engine!r} ({cls.__module__}.{cls.__qualname__}) "
                "cannot serve spot instances: it does not continue requests block by block "
                "(its block_steps is False; an instance calls step(requests, block)). Set "
                f"rollout.spot.engine to {choices('rollout', able)} with block_steps = True"
            )
        return cls


def _serves_spot(name: str) -> bool:
    """Whether the registered rollout backend ``name`` can serve spot instances (one that does
    not import, e.g. vllm without the package, is left out of messages)."""
    from ...engines.registry import engine_class

    try:
        return bool(getattr(engine_class("rollout", name), "block_steps", False))
    except Exception:  # noqa: BLE001 (an optional backend's import failing)
        return False
