"""What every workflow runner shares: config sections, value checks, checkpoints.

Runners (``workflows/*.py``) declare their configuration from these sections plus their own,
check values with :func:`require` in ``validate(cfg)`` (before anything starts), and save and
resume through :class:`Checkpoints`::

    @dataclass
    class Config:
        cluster: ClusterConfig = field(default_factory=ClusterConfig)
        trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(run_dir="runs/x"))
        resume: bool = False
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, Optional

from ..core.cluster import Offload
from ..core.config import ConfigError


@dataclass
class SpotNodesConfig:
    """Preemptible nodes of a local cluster (``m2flow.core.spot``): none by default."""

    nodes: int = 0  # spot nodes started with the cluster (and kept, unless a trace says else)
    trace: Optional[str] = None  # CSV t_s,instances replayed from the first logged step
    time_scale: float = 1.0  # trace seconds per wall second
    cpus_per_node: float = 1.0  # logical CPUs of a spot node
    seed: int = 0  # which node a preemption takes


#: bounds of the local cluster a config may ask for (beyond them: a typo, not a plan)
MAX_VIRTUAL_DEVICES = 1024
MAX_SPOT_NODES = 64


@dataclass
class ClusterConfig:
    address: Optional[str] = None  # None: embedded local Ray; "auto"/"host:port": join one
    devices_per_node: int = 1  # virtual devices per node without GPUs
    device_memory_gb: float = 16.0  # declared capacity of a virtual device
    num_cpus: Optional[int] = None  # CPUs of the embedded Ray (default: all)
    # On a device switch, offload the leaving worker: always, never, or auto (GPUs only; a
    # virtual device's memory is host RAM, so offloading there frees nothing).
    offload: Offload = Offload.auto
    spot: SpotNodesConfig = field(default_factory=SpotNodesConfig)


@dataclass
class TrainerConfig:
    steps: int = 100  # training steps (updates)
    eval_every: int = 25  # held-out evaluation every this many steps (and at the last)
    save_every: int = 25  # checkpoint every this many steps (and at the last)
    seed: int = 0  # seeds the model, sampling and data order: same seed, same run
    run_dir: str = "runs/run"  # metrics, checkpoints, trace.json and the plan report
    # metric sinks (m2flow.run.loggers): console, jsonl, tensorboard, wandb, mlflow (offline; the
    # last three are extras of the same names)
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    log_every: int = 10  # print the metrics every this many steps (and the first and last)
    # asynchronous training (m2flow.run.pipeline): rollout of later steps runs while the actor
    # trains; no token trained at version v was sampled with weights older than v - K. 0:
    # on-policy, one step at a time; "auto" (with plan=auto): the planner's K
    max_staleness: Any = 0
    # wait: a step starts once its weights are within the bound (admission control); drop: a
    # step earlier, and the samples that broke the bound are dropped (staleness_dropped)
    staleness_policy: str = "wait"


def require(checks: list[tuple[bool, str]]) -> None:
    """Raise :class:`~m2flow.core.config.ConfigError` with the message of the first failed check.

    Raises:
        ConfigError: a check is False.
    """
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)


def staleness_bound(value: Any) -> int | str:
    """``trainer.max_staleness`` checked: an integer K >= 0 (versions) or ``"auto"``.

    Raises:
        ConfigError: anything else (a negative, fractional or boolean value, another word).
    """
    if value == "auto":
        return "auto"
    k = value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        k = int(value)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ConfigError(
            f"trainer.max_staleness={value!r}: give an integer K >= 0 (weight versions a "
            "trained token may lag the weights that sampled it; 0 = on-policy) or auto (the "
            "planner's choice, with plan=auto)"
        )
    return k


def finite_positive(x: float) -> bool:
    """True for a finite number > 0 (learning rates, temperatures)."""
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def validate_cluster(c: ClusterConfig) -> None:
    """Raises ConfigError for impossible cluster values."""
    require(
        [
            (c.devices_per_node >= 1, "cluster.devices_per_node must be >= 1"),
            (
                c.devices_per_node <= MAX_VIRTUAL_DEVICES,
                f"cluster.devices_per_node={c.devices_per_node}: at most "
                f"{MAX_VIRTUAL_DEVICES} virtual devices a node (each is a Ray resource slot and "
                "a device lock); plan for more devices with m2flow plan -n N instead",
            ),
            (
                c.spot.nodes <= MAX_SPOT_NODES,
                f"cluster.spot.nodes must be <= {MAX_SPOT_NODES} (each is a local Ray node)",
            ),
            (finite_positive(c.device_memory_gb), "cluster.device_memory_gb must be > 0"),
            (c.num_cpus is None or c.num_cpus >= 1, "cluster.num_cpus must be >= 1"),
            (c.spot.nodes >= 0, "cluster.spot.nodes must be >= 0"),
            (finite_positive(c.spot.time_scale), "cluster.spot.time_scale must be > 0"),
            (
                c.address is None or not (c.spot.nodes or c.spot.trace),
                "cluster.spot needs the embedded cluster (cluster.address unset)",
            ),
        ]
    )
    if c.spot.trace:
        from ..scheduler.spot import TraceError, load_trace

        try:
            load_trace(c.spot.trace)
        except (TraceError, OSError) as e:
            raise ConfigError(f"cluster.spot.trace: {e}") from None


#: a group's checkpoint content check (``path`` -> ``None``), as the workers' layer provides
#: them (``m2flow.workers.checkpoint``): raises ``ValueError``/``OSError`` naming the problem
GroupCheck = Callable[[Path], None]


def validate_trainer(
    tr: TrainerConfig, resume: bool, groups: Mapping[str, GroupCheck] | None = None
) -> None:
    """Value checks of the trainer section and the run directory, before anything starts.

    Args:
        groups: with ``resume``, the checkpoint's groups and the content check of each (their
            files load without running code, headers match sizes): see
            :meth:`Checkpoints.check_resume`. ``None``: the groups are not checked.

    Raises:
        ConfigError: non-positive ``eval_every``/``save_every``/``log_every``, an unknown
            ``logger`` or one whose extra is missing, negative ``steps``, a
            ``run_dir`` that is a file or cannot be created (no writable directory above
            it), ``--resume`` without a checkpoint or with a damaged one or one beyond
            ``steps``, or a fresh run over an earlier run's checkpoints (nothing would be
            lost, but nothing is mixed).
        RunDirBusy: another live run holds ``run_dir`` (:mod:`m2flow.run.runlock`).
    """
    require(
        [
            (tr.steps >= 0, "trainer.steps must be >= 0"),
            (tr.eval_every >= 1, "trainer.eval_every must be >= 1 (steps between evaluations)"),
            (tr.save_every >= 1, "trainer.save_every must be >= 1 (steps between checkpoints)"),
            (tr.log_every >= 1, "trainer.log_every must be >= 1 (steps between metrics lines)"),
        ]
    )
    k = staleness_bound(tr.max_staleness)
    if tr.staleness_policy not in ("wait", "drop"):
        raise ConfigError(
            f"trainer.staleness_policy={tr.staleness_policy!r}: wait (a step starts once its "
            "weights are within the bound) or drop (it starts a step earlier; the samples "
            "that broke the bound are dropped and counted)"
        )
    if tr.staleness_policy == "drop" and k == 0:
        raise ConfigError(
            "trainer.staleness_policy=drop with trainer.max_staleness=0: an on-policy run has "
            "no bound to drop samples at; set trainer.max_staleness>=1"
        )
    from .loggers import check_loggers

    check_loggers(list(tr.logger))
    run_dir = Path(tr.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(
            f"trainer.run_dir={tr.run_dir!r} is a file, not a directory: pick another path"
        )
    base = run_dir.absolute()
    while not base.exists():  # the directory mkdir would create it in
        base = base.parent
    if not (base.is_dir() and _can_create_in(base)):
        raise ConfigError(
            f"trainer.run_dir={tr.run_dir!r} cannot be created ({base} is not a writable "
            "directory): pick a path under one"
        )
    from .runlock import check_free

    check_free(run_dir)  # before the checkpoint checks: a live run is still writing them
    latest = Checkpoints(run_dir).latest()
    if resume and latest is not None:
        Checkpoints(run_dir).check_resume(tr.steps, groups or {})
    if resume and latest is None:
        raise ConfigError(
            f"--resume: no checkpoint under {run_dir / 'checkpoints'}; run without --resume "
            "to start fresh"
        )
    if not resume and latest is not None:
        raise ConfigError(
            f"{run_dir} already holds checkpoints: pass --resume to continue that run, or set "
            "trainer.run_dir to start a new one"
        )


def _can_create_in(directory: Path) -> bool:
    """Whether a directory can be made in ``directory`` (a probe made and removed: access()
    says yes to root for /proc and read-only mounts)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".m2flow-probe-", dir=directory))
        return True
    except OSError:
        return False


def plain(section) -> dict[str, Any]:
    """A config section as a plain dict (for worker constructors)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(section, resolve=True)


def options(section) -> Any:
    """A config section as an instance of the dataclass that types it (a role's options,
    e.g. :class:`~m2flow.workers.embodied.config.PPOOptions`), to pass to the role whole.

    Raises:
        TypeError: the section is not typed by a dataclass (a free-form dict).
    """
    from omegaconf import OmegaConf

    obj = OmegaConf.to_object(section)
    if not is_dataclass(obj):
        raise TypeError(f"config section {type(obj).__name__} is not a typed options section")
    return obj


def start_cluster(c: ClusterConfig, run_dir: str | Path):
    """The run's :class:`~m2flow.core.cluster.Cluster` from the ``cluster`` section. With spot
    nodes (``cluster.spot``), a local multi-node cluster whose spot nodes come and go
    (:class:`~m2flow.core.spot.LocalSpotCluster`)."""
    from ..core.cluster import VIRTUAL_DEVICE_RESOURCE, Cluster

    spot = None
    if c.spot.nodes or c.spot.trace:
        import os

        from .._env import apply_ray_env_defaults
        from ..core.spot import LocalSpotCluster, first_step
        from ..scheduler.spot import load_trace

        apply_ray_env_defaults()
        spot = LocalSpotCluster(
            c.num_cpus or os.cpu_count() or 1,
            {VIRTUAL_DEVICE_RESOURCE: c.devices_per_node},
            spot_cpus=c.spot.cpus_per_node,
            temp_root=run_dir,  # Ray's session in <run_dir>/ray, as the plain cluster's
        )
        try:
            trace = load_trace(c.spot.trace) if c.spot.trace else []
            first = trace[0][1] if trace and trace[0][0] == 0 else c.spot.nodes
            spot.add_spot(first)
            if trace:
                first_step.clear()
                spot.replay(trace, c.spot.time_scale, c.spot.seed, start=first_step)
        except BaseException:
            spot.shutdown()
            raise
    try:
        return Cluster(
            c.address,
            num_cpus=c.num_cpus,
            virtual_devices_per_node=c.devices_per_node,
            device_memory_gb=c.device_memory_gb,
            run_dir=run_dir,
            offload=c.offload,
            spot=spot,
        )
    except BaseException:
        if spot is not None:
            import ray

            ray.shutdown()
            spot.shutdown()
        raise


class Checkpoints:
    """Checkpoints of a run: ``<run_dir>/checkpoints/step_NNNNNN/<group>/`` per trained group,
    plus ``runner.json`` (the step and the runner's own state).

    A checkpoint is written under a ``.partial`` name and renamed when complete, so a run
    killed while saving leaves the previous checkpoint as the latest: ``--resume`` never
    loads a half-written one.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir) / "checkpoints"

    def complete(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every complete checkpoint, oldest first (``step_N`` directories;
        ``step_N.partial`` and any other name, e.g. one moved aside, are not checkpoints)."""
        found = [(int(m.group(1)), p) for p in self.dir.glob("step_*")
                 if (m := re.fullmatch(r"step_(\d+)", p.name)) and p.is_dir()]  # fmt: skip
        return sorted(found)

    def latest(self) -> tuple[int, Path] | None:
        """``(step, path)`` of the newest complete checkpoint, or ``None``."""
        done = self.complete()
        return done[-1] if done else None

    def check_resume(self, steps: int, groups: Mapping[str, GroupCheck]) -> tuple[int, Path]:
        """Check the checkpoint ``--resume`` would load, before anything starts: its
        ``runner.json`` (a JSON object whose ``step`` is the directory's), a directory per
        group of ``groups``, each passing its content check, and a step within ``steps``.

        Returns:
            ``(step, path)`` of that checkpoint.

        Raises:
            ConfigError: no checkpoint; a damaged one (one line naming it, what is wrong, and
                the previous sound checkpoint with how to resume from it, if there is one); or
                one numbered beyond ``steps`` (``trainer.steps``: nothing would train).
        """
        done = self.complete()
        if not done:
            raise ConfigError(f"--resume: no checkpoint under {self.dir}")
        step, path = done[-1]
        problem = _checkpoint_problem(step, path, groups)
        if problem is not None:
            raise ConfigError(f"--resume: checkpoint {path} is damaged ({problem}); "
                              + _fallback(done, groups))  # fmt: skip
        if step > steps:
            raise ConfigError(
                f"--resume: checkpoint {path} is step {step}, beyond trainer.steps={steps}: "
                f"the run would train nothing; set trainer.steps above {step} to continue it"
            )
        return step, path

    def save(self, step: int, groups: dict[str, Any], state: dict | None = None) -> Path:
        """Save every group (its ranks' ``save_checkpoint(path)``) and the runner ``state``.

        Returns:
            the checkpoint directory.
        """
        final = self.dir / f"step_{step:06d}"
        partial = final.with_name(final.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        calls = [g.save_checkpoint(str(partial / name)) for name, g in groups.items()]
        for call in calls:
            call.wait()
        (partial / "runner.json").write_text(json.dumps({"step": step, **(state or {})}))
        os.replace(partial, final)
        return final

    def restore(self, groups: dict[str, Any]) -> tuple[int, dict]:
        """Load the newest checkpoint into ``groups``; returns ``(step, runner state)``.

        Raises:
            ConfigError: no checkpoint, or one without a group of ``groups``.
        """
        latest = self.latest()
        if latest is None:
            raise ConfigError(f"--resume: no checkpoint under {self.dir}")
        step, path = latest
        missing = [n for n in groups if not (path / n).is_dir()]
        if missing:
            raise ConfigError(
                f"checkpoint {path} has no state for {missing}: it was written by another "
                "workflow or version; start a new run_dir"
            )
        calls = [g.load_checkpoint(str(path / name)) for name, g in groups.items()]
        for call in calls:
            call.wait()
        state = json.loads((path / "runner.json").read_text())
        return step, state


def _checkpoint_problem(step: int, path: Path, groups: Mapping[str, GroupCheck]) -> str | None:
    """What is wrong with checkpoint ``path`` of ``step`` (one line), or ``None``."""
    runner = path / "runner.json"
    if not runner.is_file():
        return "no runner.json"
    try:
        state = json.loads(runner.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"runner.json is not JSON: {e}"
    if not isinstance(state, dict) or state.get("step") != step:
        return f"runner.json does not record step {step}"
    for name, check in groups.items():
        if not (path / name).is_dir():
            return f"no {name}/ directory"
        try:
            check(path / name)
        except (ValueError, OSError) as e:
            return " ".join(str(e).split()) or type(e).__name__
    return None


def _fallback(done: list[tuple[int, Path]], groups: Mapping[str, GroupCheck]) -> str:
    """How to resume without the newest checkpoint: from the newest sound earlier one."""
    for i in range(len(done) - 2, -1, -1):
        step, path = done[i]
        if _checkpoint_problem(step, path, groups) is None:
            later = [p.name for _, p in done[i + 1 :]]
            each = "it" if len(later) == 1 else "each"
            return (
                f"the previous good checkpoint is {path.name} (step {step}): move "
                f"{', '.join(later)} aside (rename {each} to <name>.damaged) and --resume "
                f"continues from step {step}"
            )
    return (
        "no earlier checkpoint is sound: restore the damaged files, or set trainer.run_dir to "
        "start a new run"
    )
