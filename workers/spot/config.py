"""Settings of the spot rollout pool (``rollout.spot`` in the LLM workflows)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpotPoolConfig:
    """The spot rollout pool (RLBoost; docs/spot.md). Off unless ``enabled``.

    Times in seconds; counts of requests (responses) unless said otherwise.
    """

    enabled: bool = False
    t_seed_init: float = 1.0  # Algorithm 1's T_init: the reserved ranks' first seeding window
    eta: float = 3.0  # Algorithm 1's adaptation rate (T_seed moves by wait difference / eta)
    memory: bool = True  # Algorithm 1's scheduler memory M (ablation: False)
    seeding: bool = True  # ablation False: no seeding, spot instances take everything
    n_prem_max: int = 0  # cap on spot instances over Algorithm 1's N_prem (0: none)
    n_prem_min: int = 1  # floor under N_prem (>= 1: the pool never turns itself off)
    theta: int = 8  # Algorithm 2's Θ: most pending requests per instance (delayed dispatch)
    dispatch: str = "jsq"  # "jsq" (Algorithm 2) or "round_robin" (ablation)
    rebalance: bool = True  # Algorithm 2's continuous rebalancing (ablation: False)
    block_tokens: int = 4  # tokens per report: a preemption loses at most one block
    max_batch: int = 64  # requests an instance executes at once
    batch_rows: int = 32  # rows of every engine forward (fixed: exact tokens; docs/spot.md)
    micro_batch_prompts: int = 4  # m_b: GRPO groups per chunk streamed to training
    threads: int = 1  # torch threads of a spot instance
    migration: str = "tokens"  # "tokens": keep the partial response; "recompute" (ablation)
    min_new_tokens: int = 0  # EOS is not sampled before this many tokens (vLLM's min_tokens)
    timeout_s: float = 1800.0  # longest wait for a step's responses

    def check(self) -> None:
        """Raises ValueError naming the first bad value."""
        bad = [
            (self.t_seed_init >= 0, "rollout.spot.t_seed_init must be >= 0"),
            (self.eta > 0, "rollout.spot.eta must be > 0"),
            (self.theta >= 1, "rollout.spot.theta must be >= 1"),
            (self.dispatch in ("jsq", "round_robin"), "rollout.spot.dispatch: jsq|round_robin"),
            (self.block_tokens >= 1, "rollout.spot.block_tokens must be >= 1"),
            (self.max_batch >= 1 and self.batch_rows >= 1, "max_batch, batch_rows must be >= 1"),
            (self.micro_batch_prompts >= 1, "rollout.spot.micro_batch_prompts must be >= 1"),
            (self.n_prem_max >= 0, "rollout.spot.n_prem_max must be >= 0"),
            (self.n_prem_min >= 1, "rollout.spot.n_prem_min must be >= 1"),
            (self.migration in ("tokens", "recompute"), "rollout.spot.migration: tokens|recompute"),
            (self.min_new_tokens >= 0, "rollout.spot.min_new_tokens must be >= 0"),
        ]
        for ok, msg in bad:
            if not ok:
                raise ValueError(msg)
