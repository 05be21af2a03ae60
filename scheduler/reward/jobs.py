"""The request and job model of the DistRS reward service (section 5.1, Table 1 and Eq. 1-2).

A request ``i`` of a batch arrives ``r_i`` seconds after the batch started and spends ``s_ij``
seconds in stage ``j`` (one worker, one request at a time); a request that fails or times out in
stage ``j`` skips the later stages (the paper records their time as zero, section 3.1; here they
are simply not entered). :class:`RequestRecord` is one request of a finished batch (the history),
:class:`SimJob` one request as the simulator sees it, :class:`JobSet` many of them as arrays.
Pure Python + numpy; seconds.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RequestRecord:
    """One request of a finished batch, as the service recorded it (the history).

    Attributes:
        offset_s: arrival offset ``r_i`` after the batch start (seconds, >= 0).
        stage_s: time spent in each stage it entered, ``s_ij`` (seconds); shorter than the
            number of stages when the request failed or timed out in its last entry (a
            timed-out stage counts its timeout, the time the worker was held).
        failed: the request stopped (failure or timeout) in its last recorded stage.
    """

    offset_s: float
    stage_s: tuple[float, ...]
    failed: bool = False

    def __post_init__(self) -> None:
        if self.offset_s < 0 or any(s < 0 for s in self.stage_s):
            raise ValueError(f"negative time in {self}: offsets and stage times must be >= 0")
        if not self.stage_s:
            raise ValueError("a request record needs the time of at least one stage")

    @property
    def zq_finish_s(self) -> float:
        """Eq. 1 of DistRS, as an offset: ``t_i = r_i + sum_j s_ij`` (seconds)."""
        return self.offset_s + sum(self.stage_s)


def earliest_completion(start_s: float, records: Sequence[RequestRecord]) -> float:
    """Eq. 1-2 of DistRS: the batch's earliest completion ``T = max_i t_i`` (absolute seconds).

    ``t_i = r_i + sum_j s_ij`` (Eq. 1) is request ``i``'s zero-queueing completion, offset from
    the batch start ``start_s``; ``T = max_i t_i`` (Eq. 2). ``records`` is the batch's previous
    batch (DistRS) or its true requests (the Ideal baseline).

    Raises:
        ValueError: no records (a batch without history has no estimate; see the policies).
    """
    if not records:
        raise ValueError("earliest_completion needs at least one request record")
    return start_s + max(r.zq_finish_s for r in records)


def ebf_priority(start_s: float, records: Sequence[RequestRecord]) -> float:
    """The EBF key of a batch (section 5.2, "Scheduling policy"; smaller is served first).

    "The expected completion time of a batch is estimated using Equation 1 and 2": the
    batch's ``T`` (:func:`earliest_completion`), fixed when the batch is announced; requests of
    one batch are served FCFS. The same key orders the live queues and the policy's simulation,
    so the simulation predicts the service.
    """
    return earliest_completion(start_s, records)


@dataclass
class SimJob:
    """One request as the simulator sees it.

    Attributes:
        batch: key of its batch (any hashable).
        arrival_s: when it enters ``first_stage`` (absolute seconds).
        first_stage: the stage it waits for (or runs in, when ``running``).
        times_s: service time of ``first_stage`` and each later stage it will enter.
        running: it already holds a worker of ``first_stage`` since ``arrival_s`` (=
            now) and keeps it until done: ``times_s[0]`` is its remaining time there.
    """

    batch: Hashable
    arrival_s: float
    first_stage: int
    times_s: tuple[float, ...]
    running: bool = False


@dataclass
class JobSet:
    """Jobs as arrays (the simulator's input); build with :meth:`from_jobs` or :meth:`concat`.

    Attributes:
        keys: batch keys; ``batch[i]`` indexes it.
        batch: per job, its batch's index in ``keys``.
        arrival: per job, when it enters its first stage (seconds).
        first: per job, its first stage.
        times: ``(n, M)`` service seconds per stage (0 where it does not enter).
        enters: ``(n, M)`` whether it enters each stage.
        running: per job, it holds a worker of its first stage already.
    """

    keys: list
    batch: np.ndarray
    arrival: np.ndarray
    first: np.ndarray
    times: np.ndarray
    enters: np.ndarray
    running: np.ndarray

    def __len__(self) -> int:
        return len(self.arrival)

    @classmethod
    def empty(cls, n_stages: int) -> JobSet:
        return cls(
            [],
            np.zeros(0, np.int64),
            np.zeros(0),
            np.zeros(0, np.int64),
            np.zeros((0, n_stages)),
            np.zeros((0, n_stages), bool),
            np.zeros(0, bool),
        )

    @classmethod
    def from_jobs(cls, jobs: Sequence[SimJob], n_stages: int) -> JobSet:
        """Arrays of ``jobs``. Raises ValueError for a job with more stages than the pipeline."""
        keys: dict = {}
        n = len(jobs)
        out = cls.empty(n_stages)
        out.batch = np.zeros(n, np.int64)
        out.arrival = np.zeros(n)
        out.first = np.zeros(n, np.int64)
        out.times = np.zeros((n, n_stages))
        out.enters = np.zeros((n, n_stages), bool)
        out.running = np.zeros(n, bool)
        for i, job in enumerate(jobs):
            f, m = job.first_stage, len(job.times_s)
            if f < 0 or m < 1 or f + m > n_stages:
                raise ValueError(f"job {i} has more stage times than the pipeline has stages")
            out.batch[i] = keys.setdefault(job.batch, len(keys))
            out.arrival[i] = job.arrival_s
            out.first[i] = f
            out.times[i, f : f + m] = job.times_s
            out.enters[i, f : f + m] = True
            out.running[i] = job.running
        out.keys = list(keys)
        return out

    @classmethod
    def concat(cls, parts: Sequence[JobSet], n_stages: int) -> JobSet:
        """One set of all ``parts`` (their batch keys merged)."""
        parts = [p for p in parts if len(p)]
        if not parts:
            return cls.empty(n_stages)
        keys: dict = {}
        batch = []
        for p in parts:
            remap = np.array([keys.setdefault(k, len(keys)) for k in p.keys], np.int64)
            batch.append(remap[p.batch])
        return cls(
            list(keys),
            np.concatenate(batch),
            np.concatenate([p.arrival for p in parts]),
            np.concatenate([p.first for p in parts]),
            np.concatenate([p.times for p in parts]),
            np.concatenate([p.enters for p in parts]),
            np.concatenate([p.running for p in parts]),
        )

    def to_jobs(self) -> list[SimJob]:
        """The jobs as :class:`SimJob` (for tests and inspection)."""
        out = []
        for i in range(len(self)):
            stages = np.nonzero(self.enters[i])[0]
            out.append(
                SimJob(
                    self.keys[self.batch[i]],
                    float(self.arrival[i]),
                    int(self.first[i]),
                    tuple(float(self.times[i, k]) for k in stages),
                    bool(self.running[i]),
                )
            )
        return out
