"""Partial rollouts that refill the tail: one rollout rank's continuous batching across steps.

With ``rollout.partial`` and a block engine (``block_steps`` and not ``generates``: ``exact``,
``emulated``), :meth:`~.worker.RolloutWorker.generate` hands its step to a
:class:`ContinuousRollout` kept on the worker. The rank decodes its share of step ``m`` a block
of ``block_tokens`` decode iterations at a time, over at most ``capacity`` sequences at once
(``rollout.spot.max_batch``: the block engine's settings serve the rank's own engine, see
:func:`block_engine_args`). A GRPO group (a prompt's ``n_samples`` requests) is admitted whole,
when ``n_samples`` slots are free: first the step's own groups, then -- once every group of
step ``m`` has started and slots free up as its responses end (the long tail) -- the *next*
steps' prompts already queued in the prompts channel, taken without blocking
(:meth:`ContinuousRollout.run`'s ``take_ready``). The call returns when every group of step
``m`` is done, with its chunks put as today; the groups of later steps it started stay on the
worker (:attr:`ContinuousRollout.carry`: their requests with tokens, per-token behaviour
logprobs and per-token weight versions, :class:`~.exact.GenRequest`) and are continued by the
next call, which counts them against its share. This is the refill the staleness cost model
assumes (``scheduler/plan/staleness.py``: "partial rollouts refill freed slots with later
steps' prompts"; veRL's fully asynchronous trainer and AReaL's interruptible rollout workers
do the same).

Weight updates reach the engine between decode iterations while a call runs
(:class:`~..llm.gate.DecodeGate`): a carried request keeps the version of each of its tokens,
so a response can span several versions; the trainer bounds and corrects that staleness.
KV cache: ``exact`` keeps none (every token is a full forward: nothing is stale, and the tokens
are those of an uninterrupted run with the same weights at the same token indices);
``emulated`` models one per request and drops it at a weight update (recomputed by the next
block's modelled prefill). Whole-group engines (``hf``, ``vllm``) do not come here: for them
``rollout.partial`` means in-flight weight updates only (their ``generate`` pauses, loads and
recomputes the cache between decode steps), without refill.

Assumptions (said here because the call cannot check them early):

- the next step's ``num_prompts`` is not known until its call arrives: the refill assumes it
  equals the current call's (GRPO's fixed prompts per step), so a rank starts at most
  ``split_evenly(num_prompts, world_size)[rank]`` groups of a later step; a call whose share is
  smaller than what was carried for it raises ``ValueError``;
- the prompts channel is FIFO and each step's items are put together (one ``put_many``), in
  step order, tagged ``"step"``. A FIFO take from the head is safe only once no earlier step's
  item is left there, which could be another rank's share: the ranks record in a
  :class:`ShareLedger` (one Ray actor per launch of the group, :class:`RemoteLedger`, with
  several ranks) the last step whose whole share each has taken, and a rank refills step
  ``s`` only when every rank has taken every step before ``s``. So with one rank the refill
  follows the slots alone; with several a rank waits for the slowest rank's blocking take of
  the current step (the head then holds ``s``'s items, at least this rank's remainder of
  them, so the non-blocking take never waits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from ..llm.placement import split_evenly
from .exact import GenRequest


@dataclass
class Group:
    """One prompt's GRPO group on this rank: its prompt item and ``n_samples`` requests.

    Attributes:
        item: the prompt item (``prompt_ids``, ``group``, ``entry``, ``step``).
        requests: one :class:`~.exact.GenRequest` per sample, key ``(step, group, j)``.
        started: admitted to the engine (its requests decode each block).
    """

    item: dict
    requests: list[GenRequest]
    started: bool = False

    @property
    def step(self) -> int:
        return int(self.item.get("step", 0))

    @property
    def done(self) -> bool:
        return all(r.done for r in self.requests)

    @property
    def live(self) -> int:
        """Sequences it holds in the engine (started and not finished)."""
        return sum(not r.done for r in self.requests) if self.started else 0


@dataclass
class CallStats:
    """What one :meth:`ContinuousRollout.run` did (all counts on this rank).

    Attributes:
        carried_in: groups of this step started by an earlier call (refill).
        carried_out: groups of later steps kept for the next calls.
        refilled: groups of later steps this call started.
        blocks: engine calls (blocks of ``block_tokens`` decode iterations).
        tokens: tokens generated (all steps' requests).
    """

    carried_in: int = 0
    carried_out: int = 0
    refilled: int = 0
    blocks: int = 0
    tokens: int = 0


class ContinuousRollout:
    """See the module docstring. One per rollout rank, alive across its ``generate`` calls.

    Args:
        engine: a block engine (``step(requests, tokens)``, :class:`~.exact.ExactEngine`,
            :class:`~.emulated.EmulatedEngine`).
        n_samples: GRPO group size (requests per prompt).
        max_new_tokens: the response cap (tokens, EOS included).
        capacity: most sequences decoding at once (>= ``n_samples``).
        block_tokens: decode iterations per engine call: the refill's granularity (a freed slot
            waits at most one block).
        rank, world_size: this rank in the rollout group (its share of each step).
        ledger: where the ranks record the steps whose whole share they have taken
            (:class:`ShareLedger`; shared by the ranks: :class:`RemoteLedger`); default: this
            rank's own (right for one rank).

    Raises:
        ValueError: ``capacity < n_samples`` or ``block_tokens < 1``.
    """

    def __init__(
        self,
        engine,
        n_samples: int,
        max_new_tokens: int,
        capacity: int,
        block_tokens: int,
        rank: int = 0,
        world_size: int = 1,
        ledger: ShareLedger | None = None,
    ) -> None:
        if capacity < n_samples:
            raise ValueError(
                f"rollout.spot.max_batch={capacity} < rollout.n_samples={n_samples}: partial "
                "rollouts admit whole groups; raise max_batch"
            )
        if block_tokens < 1:
            raise ValueError(f"rollout.spot.block_tokens must be >= 1, got {block_tokens}")
        self.engine, self.n_samples, self.max_new_tokens = engine, n_samples, max_new_tokens
        self.capacity, self.block_tokens = capacity, block_tokens
        self.rank, self.world_size = rank, world_size
        self.ledger = ledger if ledger is not None else ShareLedger(world_size)
        #: groups of later steps kept between calls (started or finished, with their tokens)
        self.carry: list[Group] = []
        self._take_ready: Callable[[int], list[dict]] = lambda n: []
        self._share = 0  # this rank's share of the current (and, assumed, later) steps

    # -- one step ----------------------------------------------------------------------------

    def run(
        self,
        num_prompts: int,
        take_share: Callable[[int], list[dict]],
        take_ready: Callable[[int], list[dict]],
        emit: Callable[[list[Group]], None],
        granularity: int | None = None,
    ) -> CallStats:
        """Generate this rank's share of one step (the step of the carried groups, or of the
        items ``take_share`` returns) and hand its finished groups to ``emit``.

        Args:
            num_prompts: prompts of the step on all ranks (this rank's share:
                ``split_evenly(num_prompts, world_size)[rank]``).
            take_share: ``n -> n items``, blocking: the rest of the share from the channel.
            take_ready: ``n -> at most n items``, not blocking: queued items of later steps
                (``[]``: none now, or refill not allowed).
            emit: called with finished groups of the step, ``granularity`` at a time (the
                rest at the end), in finishing order.
            granularity: groups per ``emit`` (``None``: the whole share at once).

        Returns:
            the call's :class:`CallStats`.

        Raises:
            ValueError: more groups carried for this step than its share (a ``num_prompts``
                smaller than the previous call's).
            RuntimeError: items of another step than the call's arrived (the channel does not
                hold the steps in order).
        """
        share = self._share = split_evenly(num_prompts, self.world_size)[self.rank]
        stats = CallStats()
        step = min((g.step for g in self.carry), default=None)
        mine = [g for g in self.carry if g.step == step] if step is not None else []
        stats.carried_in = len(mine)
        if len(mine) > share:
            raise ValueError(
                f"rollout rank {self.rank}: {len(mine)} groups of step {step} were started "
                f"ahead but its share is {share} (num_prompts={num_prompts}): rollout.partial "
                "assumes every step has the num_prompts of the one before"
            )
        new = [
            self._group(it) for it in (take_share(share - len(mine)) if share > len(mine) else [])
        ]
        if step is None and new:
            step = new[0].step
        if any(g.step != step for g in new):
            raise RuntimeError(
                f"rollout rank {self.rank}: step {step}'s call got items of steps "
                f"{sorted({g.step for g in new})}: the prompts channel must hold the steps in "
                "order, each step's items put together"
            )
        self.carry = [g for g in self.carry if g.step != step]
        self._take_ready = take_ready
        if step is not None:
            self.ledger.mark(self.rank, step)  # this rank's whole share of it is taken
        groups = mine + new  # this step's, in admission order
        size = granularity or max(share, 1)
        ready: list[Group] = []
        seen: set[int] = set()  # ids of groups put in ready

        def collect(last: bool) -> None:
            for g in groups:
                if g.done and id(g) not in seen:
                    seen.add(id(g))
                    ready.append(g)
            while ready and (last or len(ready) >= size):
                part, ready[:] = ready[:size], ready[size:]
                emit(part)

        collect(False)
        while any(not g.done for g in groups):
            self._admit(groups, stats, step, share)
            live = [r for g in groups + self.carry if g.started for r in g.requests if not r.done]
            made = self.engine.step(live, self.block_tokens)
            stats.blocks += 1
            stats.tokens += made
            collect(False)
        collect(True)
        stats.carried_out = len(self.carry)
        return stats

    def _admit(self, groups: list[Group], stats: CallStats, step: int, share: int) -> None:
        """Start waiting groups of this step while ``n_samples`` slots are free; once all have
        started, take queued groups of later steps into the free slots (refill)."""
        free = self.capacity - sum(g.live for g in groups + self.carry)
        for g in groups:
            if not g.started:
                if free < self.n_samples:
                    return
                g.started, free = True, free - self.n_samples
        while free >= self.n_samples and self._may_refill(step, share):
            n = min(free // self.n_samples, self._refill_room(step, share))
            got = self._take(step, n)
            if not got:
                return
            free -= self.n_samples * len(got)
            stats.refilled += len(got)

    def _may_refill(self, step: int, share: int) -> bool:
        """Whether the channel's head holds only items of the step the refill fills: every
        rank has taken its whole share of every step before it (the ledger's floor). A FIFO
        take before that could take another rank's share of an earlier step."""
        floor = self.ledger.floor()
        if floor is None:
            return False
        last = max((g.step for g in self.carry), default=step)
        if last > step and sum(g.step == last for g in self.carry) < share:
            return floor >= max([step] + [g.step for g in self.carry if g.step < last])
        return floor >= max(step, last)

    def _refill_room(self, step: int, share: int) -> int:
        """Groups the refill may take now: the rest of this rank's share (the assumed
        ``num_prompts``) of the latest later step it has started, else a whole share of the
        next one."""
        last = max((g.step for g in self.carry), default=None)
        if last is None or last <= step:
            return share
        have = sum(g.step == last for g in self.carry)
        return share - have if have < share else share

    def _take(self, step: int, n: int) -> list[Group]:
        """Take up to ``n`` queued items of later steps (not blocking), started at once."""
        groups = [self._group(it) for it in (self._take_ready(n) if n > 0 else [])]
        floor = max([step + 1] + [g.step for g in self.carry])
        if any(g.step < floor for g in groups):
            raise RuntimeError(
                f"rollout rank {self.rank}: while generating step {step}, the refill took "
                f"items of steps {sorted({g.step for g in groups})} (expected >= {floor}): "
                "the prompts channel must hold the steps in order, each step's items put together"
            )
        for g in groups:
            g.started = True
        self.carry += groups
        for s in sorted({g.step for g in groups}):
            if sum(g.step == s for g in self.carry) >= self._share:
                self.ledger.mark(self.rank, s)
        return groups

    def _group(self, item: dict) -> Group:
        s, p = int(item.get("step", 0)), int(item["group"])
        reqs = [
            GenRequest(f"{s}:{p}:{j}", list(item["prompt_ids"]), (s, p, j), self.max_new_tokens,
                       owner=self.rank)
            for j in range(self.n_samples)
        ]  # fmt: skip
        return Group(item, reqs)


class ShareLedger:
    """Per rollout rank, the last step whose whole share it has taken from the prompts
    channel. Its :meth:`floor` is the last step every rank has taken whole: the channel's
    head then holds only later steps' items (FIFO, steps in order).

    Args:
        world_size: the rollout ranks that record.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.done: dict[int, int] = {}

    def mark(self, rank: int, step: int) -> None:
        """``rank`` has taken its whole share of ``step`` (and of every step before it)."""
        self.done[rank] = max(step, self.done.get(rank, step))

    def floor(self) -> int | None:
        """The last step every rank has taken whole (``None``: a rank has recorded none)."""
        if len(self.done) < self.world_size:
            return None
        return min(self.done.values())


class RemoteLedger:
    """A :class:`ShareLedger` shared by the rollout ranks: a named Ray actor (no CPUs)
    created by the first rank that asks, ``name`` unique to one launch of the group.

    Raises:
        ray.exceptions.GetTimeoutError: the actor did not answer within 60 s.
    """

    def __init__(self, name: str, world_size: int) -> None:
        import ray

        from m2flow.core.cluster import NAMESPACE

        self._get = ray.get
        actor = ray.remote(num_cpus=0)(ShareLedger)
        self.actor = actor.options(name=name, namespace=NAMESPACE, get_if_exists=True).remote(
            world_size
        )

    def mark(self, rank: int, step: int) -> None:
        self._get(self.actor.mark.remote(rank, step), timeout=60)

    def floor(self) -> int | None:
        return self._get(self.actor.floor.remote(), timeout=60)


def block_engine_args(spot, tokenizer) -> dict:
    """A rank's own block engine's arguments under ``rollout.partial`` (no spot pool): the
    block-engine settings of ``rollout.spot`` (:class:`~.spot.config.SpotPoolConfig`:
    ``batch_rows``, ``min_new_tokens``, ``decode_delay_s``, ``emulated``) and the emulated
    engine's placeholder tokens (``eos_id``, ``filler_id``: the last id), as the spot pool gives
    its inner engine."""
    return {
        "batch_rows": spot.batch_rows, "min_new_tokens": spot.min_new_tokens,
        "decode_delay_s": spot.decode_delay_s, "emulated": asdict(spot.emulated),
        "eos_id": tokenizer.eos_token_id, "filler_id": len(tokenizer) - 1,
    }  # fmt: skip
