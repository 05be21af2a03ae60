"""A CUDA-reward-service workload shaped like the DistRS trace (sections 3 and 6.1).

The paper evaluates on a trace of a CUDA code-generation RL task that is not public; this draws
batches with the properties the paper reports for it:

- two stages (section 2.2, Figure 4(a)): ``compile`` on a CPU worker (4 cores, 16 GB) and
  ``execute`` on a GPU worker; "normal requests typically require around 50 seconds for
  compilation and a few seconds for execution, while the timeout thresholds are set to 120
  seconds for compilation and 60 seconds for execution" (section 3.1);
- 2048 requests per batch (section 3); arrivals "sparse or absent" at the start of the rollout,
  then a rapid rise to a peak of ~17 requests/s (the paper: over 180 per 10 s) and a long
  tail (Figure 5); adjacent batches alike (Figure 5(c)): the arrival scale drifts ~10 %;
- request states (Figure 6(b)) drifting with training progress ``p`` in [0, 1]: *generation
  failed* (no code: 0 s of compilation, no execution) falls from 45 % to 5 %, *compile failed*
  from 25 % to 10 %, *execute error* rises then falls (15 % -> 25 % -> 15 %), *success* rises
  from 15 % to 70 %; "a small fraction take significantly longer", many of them "only upon
  reaching the timeout thresholds" (Figure 6(c)): 2 % of compilations and 3 % of executions
  run to their timeout, 3 % / 2 % take several times the usual time;
- six tasks replay it with start times "staggered within a short time window"; colocated
  (idle gaps between batches: a training step of ~250 s after each batch, so an iteration is
  over 600 s and about half of it sees no request) or disaggregated with one-step staleness
  (continuous rollout; :mod:`~m2flow.scheduler.reward.replay`).

Worker costs ``C_j`` (Eq. 5) are not given in the paper: one GPU executor is taken to cost 10
CPU compilers (cloud list prices: ~$2/h for a GPU, ~$0.2/h for 4 cores and 16 GB). They only
order Algorithm 1's search (GPU first); GPU and CPU time are reported separately.
Pure numpy; seconds.
"""

from __future__ import annotations

import numpy as np

from .replay import TenantTrace
from .sim import RequestRecord

STAGES = ("compile", "execute")
RESOURCES = ("CPU", "GPU")
TIMEOUTS_S = (120.0, 60.0)
COSTS = (1.0, 10.0)
HANG = (0.01, 0.01)  # per stage, share of the requests entering it that run to the timeout
SLOW = (0.02, 0.015)  # per stage, share that take several times the usual time


def state_shares(progress: float) -> tuple[float, float, float, float]:
    """Shares of generation failed, compile failed, execute error, success at ``progress``."""
    p = min(max(progress, 0.0), 1.0)
    gen = 0.45 - 0.40 * p
    cfail = 0.25 - 0.15 * p
    eerr = 0.15 + 0.40 * p * (1.0 - p)
    return gen, cfail, eerr, 1.0 - gen - cfail - eerr


def cuda_batch(
    rng: np.random.Generator, size: int = 2048, progress: float = 0.5, scale: float = 1.0
) -> list[RequestRecord]:
    """One batch of ``size`` requests at training ``progress``; ``scale`` stretches arrivals.

    Raises:
        ValueError: ``size < 1`` or ``scale <= 0``.
    """
    if size < 1 or scale <= 0:
        raise ValueError(f"need size >= 1 and scale > 0, got {size}, {scale}")
    # arrivals: nothing for ~30 s, a peak near 90 s, a long tail, capped at the 16K-token end
    r = np.minimum(scale * (30.0 + 80.0 * rng.lognormal(0.0, 0.6, size)), scale * 400.0)
    gen, cfail, eerr, _ = state_shares(progress)
    u = rng.random(size)
    kind = np.select([u < gen, u < gen + cfail, u < gen + cfail + eerr], [0, 1, 2], 3)
    out = []
    cto, eto = TIMEOUTS_S
    for i in range(size):
        k = kind[i]
        if k == 0:  # generation failed: text checks fail, nothing is compiled
            out.append(RequestRecord(float(r[i]), (0.0,), True))
            continue
        v = rng.random()
        if v < HANG[0]:  # a hung compilation: killed at its timeout
            out.append(RequestRecord(float(r[i]), (cto,), True))
            continue
        c = rng.lognormal(np.log(35.0 if k == 1 else 48.0), 0.3 if k == 1 else 0.12)
        if v < HANG[0] + SLOW[0]:  # a slow one
            c *= rng.uniform(1.5, 2.4)
        c = float(min(c, cto))
        if k == 1 or c >= cto:
            out.append(RequestRecord(float(r[i]), (c,), True))
            continue
        w = rng.random()
        if w < HANG[1]:  # an infinite loop: killed at its timeout
            out.append(RequestRecord(float(r[i]), (c, eto), True))
            continue
        e = rng.lognormal(np.log(2.5 if k == 2 else 4.0), 0.5 if k == 2 else 0.35)
        if w < HANG[1] + SLOW[1]:
            e *= rng.uniform(2.0, 10.0)
        e = float(min(e, eto))
        out.append(RequestRecord(float(r[i]), (c, e), k == 2 or e >= eto))
    return out


def cuda_tenants(
    n_tenants: int = 6,
    n_batches: int = 10,
    size: int = 2048,
    mode: str = "colocated",
    delay_bound_s: float = 5.0,
    seed: int = 0,
    window_s: float = 120.0,
    progress: float = 0.3,
) -> list[TenantTrace]:
    """``n_tenants`` tasks replaying the trace (module doc), each with ``n_batches`` batches
    from training ``progress`` on, 1/50 of the training per batch (the paper's trace has 50
    iterations), and a warm-up (profiling) batch as the first batch's history; starts uniform
    in ``[0, window_s]``."""
    rng = np.random.default_rng(seed)
    tenants = []
    for ti in range(n_tenants):
        steps = progress + 0.02 * np.arange(n_batches + 1)
        scales = np.clip(1.0 + 0.02 * np.cumsum(rng.standard_normal(n_batches + 1)), 0.8, 1.2)
        batches = [cuda_batch(rng, size, float(p), float(s)) for p, s in zip(steps, scales)]
        tenants.append(
            TenantTrace(
                name=f"task{ti}",
                start_s=float(rng.uniform(0.0, window_s)),
                batches=batches[1:],
                warmup=batches[0],
                train_s=float(rng.uniform(220.0, 280.0)),
                delay_bound_s=delay_bound_s,
                mode=mode,
            )
        )
    return tenants
