"""Rollout worker: batched sampling with transformers, fed and drained through channels."""

from __future__ import annotations

import logging
from dataclasses import asdict

import torch

from m2flow import Channel, Worker, control_method, group_method

from ..batch import num_tokens, to_batch
from ..chunk import RolloutChunk
from ..data.item import PromptItem
from ..engines.lora import MergedWeights, apply_payload, is_adapter, payload_bytes
from ..llm import build_tokenizer, compute_dtype, load_model
from ..llm.config import resolved_max_new_tokens
from ..llm.placement import (
    offload_module,
    onload_module,
    set_torch_threads,
    split_evenly,
    torch_device,
)
from ..scoring.evaluation import greedy_scores
from ..scoring.functions import RewardFunction
from .config import RolloutOptions
from .continuous import ContinuousRollout, RemoteLedger, block_engine_args
from .engines import build_rollout_engine, check_rollout
from .exact import to_generation_output

log = logging.getLogger(__name__)


class RolloutWorker(Worker):
    """Generates GRPO groups: ``n_samples`` responses per prompt (HF ``generate``, KV cache).

    Args:
        model: :class:`~m2flow.workers.llm.ModelConfig` fields: a Hugging Face directory
            (``path``) or a shape (weights arrive by ``m2flow.sync_weights(actor, rollout)``),
            ``dtype``.
        tokenizer: the tokenizer spec, ``{"name": "char", "alphabet": str}`` or
            ``{"name": "qwen2"}`` (:func:`~m2flow.workers.llm.build_tokenizer`).
        options: :class:`~.config.RolloutOptions`, the workflow's ``rollout`` section:
            ``n_samples`` (GRPO group size), ``max_new_tokens`` (``None``: the model's default,
            :func:`~..llm.config.resolved_max_new_tokens`), ``temperature``, ``top_p``,
            ``shared_prefix`` (prefill each prompt once for its ``n_samples`` samples),
            ``threads`` (0: this rank's share of its node's CPUs), ``engine`` (a registered
            backend of kind ``rollout``, :mod:`~..engines.registry`, or an import path: it
            samples and takes weight updates; ``self.model`` still holds the weights for
            :meth:`evaluate`) and ``spot`` (with ``enabled``, the engine is the spot rollout
            pool composed over the configured one: RLBoost, docs/results/spot.md,
            :func:`~.engines.build_rollout_engine`). The engine is asked at launch whether it
            runs them on this group's ranks (its ``check``, :func:`~.engines.check_rollout`).
            ``partial`` (partial rollouts, issue 32): with a block engine (``exact``,
            ``emulated``) :meth:`generate` batches continuously across steps and refills freed
            slots with the next steps' queued prompts (:mod:`~.continuous`); with ``hf`` /
            ``vllm`` it changes nothing here (their weight updates land between decode steps
            anyway).
        heldout: the held-out prompts :meth:`evaluate` decodes (ranks take shards).
        reward: :class:`~..scoring.functions.RewardFunction` arguments: how :meth:`evaluate`
            scores (default: ``auto``).
        seed: the run seed: token ``t`` of sample ``j`` of prompt ``p`` in step ``s`` is drawn
            from a counter keyed by ``(seed, s, p, j, t)`` (:mod:`~..llm.sampling`), so responses do
            not depend on the rank, chunk or plan that generated them.

    Raises:
        ValueError: an engine that does not run the options (its message names the setting
            and the fix).

    The role holds no engine branches: whatever the engine (the pool included), a step is
    :meth:`generate`, a weight sync :meth:`load_weights`, and :meth:`pause` / :meth:`resume`
    reach the engine between its decode steps.
    """

    weight_sync_bytes = 0  # the last weight sync's payload (its tensors' bytes)
    #: a subclass that steps a block engine (exact, emulated) itself: the agent rollout's loop
    drives_blocks = False
    _merged: MergedWeights | None = None  # merges LoRA adapters for an engine that cannot

    def __init__(
        self,
        model: dict,
        tokenizer: dict,
        options: RolloutOptions,
        heldout: list[PromptItem] | None = None,
        reward: dict | None = None,
        seed: int = 0,
    ) -> None:
        o = self.options = options
        # a role that steps block engines itself (drives_blocks) takes exact/emulated as its own
        own_blocks = bool(o.partial) or self.drives_blocks
        check = {**o.engine_check(model), "partial": own_blocks}
        cls = check_rollout(check, self.world_size)  # what the engine refuses
        set_torch_threads(self, o.threads)
        self.device = torch_device(self.devices)
        self.tokenizer = build_tokenizer(tokenizer)
        # Weights in model.dtype (inference only); sync_weights casts the actor's into them.
        self.model = load_model(model, self.tokenizer, self.device).eval()
        self.n_samples = o.n_samples
        self.max_new_tokens = resolved_max_new_tokens(model, o.max_new_tokens)
        self.heldout = heldout
        self.reward = RewardFunction(**(reward or {}))
        self.seed = seed
        args = {
            "model": model, "tokenizer": tokenizer, "temperature": o.temperature,
            "top_p": o.top_p, "seed": seed, "shared_prefix": o.shared_prefix,
            "dtype": str(compute_dtype(model.get("dtype", "auto"), self.device)).split(".")[-1],
            "rank": self.rank, "world_size": self.world_size, "name": self.worker_key,
        }  # fmt: skip
        spot = asdict(o.spot)
        # rollout.partial on a block engine (exact, emulated): continuous batching across steps
        blocks = own_blocks and cls.block_steps and not cls.generates
        if blocks:
            args.update(block_engine_args(o.spot, self.tokenizer))
        self.engine = build_rollout_engine(
            o.engine, args, self.model, self.tokenizer, spot, partial=own_blocks
        )
        self.continuous = None
        if blocks and o.partial:
            ledger = None  # one rank: its own
            if self.world_size > 1:  # shared by this launch's ranks (continuous.py)
                launch = getattr(self._m2flow_ctx, "launch_index", 0)
                ledger = RemoteLedger(f"m2flow:partial_ledger:{self.group_name}:{launch}",
                                      self.world_size)  # fmt: skip
            self.continuous = ContinuousRollout(
                self.engine, self.n_samples, self.max_new_tokens, o.spot.max_batch,
                o.spot.block_tokens, self.rank, self.world_size, ledger=ledger,
            )  # fmt: skip
        self.model.to(self.device)  # (vLLM was built from a CPU copy)

    # -- generation -------------------------------------------------------------------------

    @group_method
    def generate(self, prompts: Channel, out: Channel, num_prompts: int) -> dict:
        """Take this rank's share of ``num_prompts`` prompts from ``prompts`` in chunks of the
        plan's granularity (:meth:`~m2flow.Worker.chunk_size`; the whole share without a
        plan, or with an engine that balances the step itself, ``whole_share``: the spot
        pool); put one rollout chunk per prompt chunk into ``out`` (an engine with ``stream``
        puts one per part it yields: the pool's finished micro-batches of groups).

        A prompt item is ``{"prompt_ids": list[int], "group": int, "entry": dict}`` (the
        entry: :meth:`~..data.item.PromptItem.entry`, for the reward) plus optionally
        ``"step": int`` (the sampling key; 0 if absent); ``group`` is unique within
        the step. A rollout chunk is a :class:`~..chunk.RolloutChunk` (``batch [chunk *
        n_samples]``, ``entries`` by group, ``weight_version``, ``step``, ``step_samples``) put
        with weight = its token count; ``step_samples = num_prompts * n_samples`` is the number
        of responses the whole step will have (all ranks): a consumer may announce it before
        the step's last chunk (the reward service's batch-size hint,
        docs/results/reward_service.md).

        With ``rollout.partial`` on a block engine (:mod:`~.continuous`): chunks of finished
        groups in finishing order; the share counts the groups an earlier call started ahead
        (carried); the groups of later steps started here stay on the rank for their call.

        Returns:
            ``samples``, ``tokens`` (prompt + response), ``response_length`` (mean tokens),
            plus the engine's ``last_metrics()`` (the spot pool: ``seeded_s``,
            ``weight_versions``, ``spot``).
        """
        share = split_evenly(num_prompts, self.world_size)[self.rank]
        step_samples = num_prompts * self.n_samples
        # an engine that balances the step itself (the spot pool) takes the whole share
        whole = getattr(self.engine, "whole_share", False)
        granularity = share if whole else self.chunk_size(default=share)
        stream = getattr(self.engine, "stream", None)
        if self.continuous is not None:
            return self._generate_continuous(prompts, out, num_prompts, granularity)
        samples = tokens = resp_tokens = 0
        while share > 0:
            size = min(granularity, share)
            items = prompts.get_batch(size, max_items=size)
            share -= len(items)
            args = ([it["prompt_ids"] for it in items], self.n_samples, self.max_new_tokens,
                    [(it.get("step", 0), it["group"]) for it in items])  # fmt: skip
            groups = torch.tensor([it["group"] for it in items], device="cpu")
            for gen in stream(*args) if stream is not None else [self.engine.generate(*args)]:
                gen["group_index"] = groups[gen["group_index"]]
                n, n_tok, n_resp = self._put(out, gen, items, step_samples)
                samples += n
                tokens += n_tok
                resp_tokens += n_resp
        extra = self.engine.last_metrics() if hasattr(self.engine, "last_metrics") else {}
        return {
            "samples": samples,
            "tokens": tokens,
            "response_length": resp_tokens / max(samples, 1),
            **extra,
        }

    def _put(self, out: Channel, gen: dict, items: list[dict], step_samples: int):
        """Put one generation output (``group_index``: prompt ids) as a rollout chunk; returns
        its ``(samples, tokens, response tokens)``."""
        batch = to_batch(gen)
        present = set(batch["group_index"].tolist())
        n_tok = num_tokens(batch)
        chunk = RolloutChunk(
            batch,
            entries={it["group"]: it["entry"] for it in items if it["group"] in present},
            weight_version=self._oldest_version(batch),
            step=items[0].get("step", 0),
            step_samples=step_samples,
        )
        out.put(chunk, weight=n_tok)
        return len(batch), n_tok, int(batch["response_mask"].sum())

    def _generate_continuous(
        self, prompts: Channel, out: Channel, num_prompts: int, granularity: int
    ) -> dict:
        """:meth:`generate` with ``rollout.partial`` on a block engine: the rank's
        :class:`~.continuous.ContinuousRollout` (refills freed slots with the next steps'
        queued prompts; keeps their started requests for the next call). Chunks of
        ``granularity`` finished groups, in finishing order. Returns :meth:`generate`'s
        metrics plus ``partial_carried_in`` / ``partial_refilled`` / ``partial_carried_out``
        (groups) and ``partial_blocks`` (engine calls)."""
        totals = [0, 0, 0]
        pad = self.tokenizer.pad_token_id

        def take_share(n: int) -> list[dict]:
            items: list[dict] = []
            while len(items) < n:
                size = min(granularity, n - len(items))
                items += prompts.get_batch(size, max_items=size)
            return items

        def take_ready(n: int) -> list[dict]:  # (the ledger said the head is the step's)
            k = min(n, prompts.qsize())
            return prompts.get_batch(k, max_items=k) if k > 0 else []

        def emit(groups) -> None:
            reqs = [r for g in groups for r in g.requests]
            gen = to_generation_output(reqs, pad, self.n_samples)
            for i, v in enumerate(self._put(out, gen, [g.item for g in groups], step_samples)):
                totals[i] += v

        step_samples = num_prompts * self.n_samples
        st = self.continuous.run(num_prompts, take_share, take_ready, emit, granularity)
        samples, tokens, resp_tokens = totals
        extra = self.engine.last_metrics() if hasattr(self.engine, "last_metrics") else {}
        return {
            "samples": samples,
            "tokens": tokens,
            "response_length": resp_tokens / max(samples, 1),
            "partial_carried_in": st.carried_in,
            "partial_refilled": st.refilled,
            "partial_carried_out": st.carried_out,
            "partial_blocks": st.blocks,
            **extra,
        }

    def _oldest_version(self, batch) -> int:
        """The oldest weight version among the batch's tokens (its ``versions``), or this
        rank's weights' version for an engine that reports none."""
        mask = batch["response_mask"].bool()
        if "versions" not in batch.keys() or not mask.any():  # (episodes that ended at reset)
            return self.weight_version
        return int(batch["versions"][mask].min())

    # -- control (between the engine's decode steps) ----------------------------------------

    @control_method  # arrives while generate() runs
    def pause(self) -> None:
        """Stop the engine's generation in flight at its next decode-step boundary (returns
        once there); it keeps its sequences until :meth:`resume`."""
        self.engine.pause()

    @control_method
    def resume(self) -> None:
        """Continue the paused generation, with the weights loaded meanwhile."""
        self.engine.resume()

    # -- weights ----------------------------------------------------------------------------

    def load_weights(self, weights: dict, version: int) -> None:
        """Load the policy's weights (``m2flow.sync_weights``) into the engine, between its
        decode steps (:meth:`~m2flow.workers.engines.rollout.RolloutEngine.update_weights`: the
        spot pool also stages them for its instances), and into ``self.model`` (the held-out
        evaluation's) when the engine samples from a copy of its own (vLLM, emulated).

        A LoRA adapter payload (:mod:`~..engines.lora`: the adapter alone, the base on the first
        sync) goes to an engine that ``applies_adapter`` (``hf``) as it is; any other gets the
        merged weights (said once, in the log). ``weight_sync_bytes``: the payload's size."""
        self.weight_sync_bytes = payload_bytes(weights)
        if is_adapter(weights) and not getattr(self.engine, "applies_adapter", False):
            if self._merged is None:
                self._merged = MergedWeights()
                log.warning(
                    "rollout engine %s cannot apply a LoRA adapter: it gets the merged weights "
                    "(the adapter alone still travels; this rank merges it)",
                    type(self.engine).__name__,
                )
            weights = self._merged(weights)
        self.engine.update_weights(version, weights)
        if self.engine.model is not self.model:
            apply_payload(self.model, weights)

    # -- evaluation -------------------------------------------------------------------------

    @group_method
    def evaluate(self) -> dict:
        """Greedy rewards of this rank's shard of the held-out prompts, scored by the run's
        reward function.

        Returns:
            ``scores`` (one per held-out item of the shard; accuracy counts score == 1) and
            ``reward_errors`` (penalised samples, ``on_error="penalty"``).

        Raises:
            ValueError: launched without ``heldout`` prompts.
            RewardFunctionError: the reward function failed (``on_error="raise"``).
        """
        if not self.heldout:
            raise ValueError("evaluate() needs held-out prompts: launch with heldout=[...]")
        items = self.heldout[self.rank :: self.world_size]
        res = greedy_scores(self.model, self.tokenizer, items, self.reward, self.max_new_tokens)
        return {"scores": res.scores, "reward_errors": res.errors}

    # -- memory -----------------------------------------------------------------------------

    def offload(self) -> None:
        # Weights can always be re-synced, but moving them is cheaper than a resync here.
        offload_module(self.model, self.device)
        self.engine.sleep()  # vLLM on GPU: sleep level 1 (weights to host, KV cache freed)

    def onload(self) -> None:
        onload_module(self.model, self.device)
        self.engine.wake_up()
