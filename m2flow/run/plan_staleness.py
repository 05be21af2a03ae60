"""``m2flow plan --staleness``: the asynchronous pipeline's rows per ``(K, placement)``
(issue 32 item 4; the model is :mod:`m2flow.scheduler.plan.staleness`), from the command's
options, and their table.
"""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console
from rich.table import Table


def lengths_arg(text: str | None):
    """``--lengths``: ``(lengths, source)``; ``(None, "")`` without it."""
    from ..core.config import ConfigError
    from ..scheduler.plan.staleness import capped_lognormal

    if text is None:
        return None, ""
    try:
        if text.startswith("lognormal:"):
            median, sigma, cap = (float(x) for x in text.split(":", 1)[1].split(","))
            return capped_lognormal(median, sigma, cap), f"capped lognormal {text[10:]}"
        vals = [float(x) for x in Path(text).read_text().split()]
        if not vals or min(vals) < 0:
            raise ValueError("give at least one length, none negative")
        return vals, f"{len(vals)} lengths from {text}"
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"--lengths {text!r}: write lognormal:MEDIAN,SIGMA,CAP (tokens) or a file of "
            f"lengths, one a line ({e})"
        ) from None


def staleness_rows(prof, devices, capacity, mode, spot, idle, slack, max_k, k_slack, sync_s,
                   lengths):  # fmt: skip
    """The :class:`~m2flow.scheduler.plan.staleness.StalenessPlan` for ``m2flow plan
    --staleness`` (the options' values as given).

    Raises:
        ConfigError: a negative ``--max-staleness``, a slack outside [0, 1), a negative
            ``--sync-s`` or a bad ``--lengths``.
    """
    from ..core.config import ConfigError
    from .planning import staleness_from_profile

    if max_k < 0:
        raise ConfigError(f"--max-staleness {max_k}: give a whole number >= 0 (model versions)")
    if not 0.0 <= k_slack < 1.0:
        raise ConfigError(f"--staleness-slack {k_slack}: give a fraction in [0, 1), e.g. 0.05")
    if not sync_s >= 0:
        raise ConfigError(f"--sync-s {sync_s}: give seconds >= 0")
    vals, source = lengths_arg(lengths)
    opts = {"allow_idle": idle, **({} if slack is None else {"slack": slack})}
    return staleness_from_profile(
        prof, devices, capacity, mode, spot, max_staleness=max_k, staleness_slack=k_slack,
        sync_s=sync_s, lengths=vals, length_source=source, **opts,
    )  # fmt: skip


def print_staleness(out: Console, sp, prof) -> None:
    """The ``(K, placement)`` table with the choice marked, and the choice in one line."""
    base = max((r.items_per_s for r in sp.rows if r.k == 0), default=0.0)
    t = Table(title="asynchronous pipeline: bounded staleness K (model versions)")
    for col in ("", "K", "placement", "step s", f"{prof.item}s/s", "vs best K=0", "mean staleness"):
        t.add_column(col, justify="left" if col in ("", "placement") else "right")
    for r in sp.rows:
        mark = "[bold green]chosen[/]" if r == sp.chosen else ""
        gain = f"{r.items_per_s / base:.3f}x" if base > 0 and math.isfinite(base) else "-"
        t.add_row(mark, str(r.k), r.placement, f"{r.step_s:.4f}", f"{r.items_per_s:.3f}", gain,
                  f"{r.mean_staleness:.2f}")  # fmt: skip
    out.print(t)
    c = sp.chosen
    out.print(
        f"staleness: K={c.k} on {c.placement}: {c.step_s:.4f} s per step, {c.items_per_s:.3f} "
        f"{prof.item}s/s (the smallest K within the slack of the best); {sp.note}",
        highlight=False,
    )
