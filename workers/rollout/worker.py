"""Rollout worker: batched sampling with transformers, fed and drained through channels."""

from __future__ import annotations

import torch

from m2flow import Channel, Worker

from ..batch import num_tokens, to_batch
from ..chunk import RolloutChunk
from ..data.item import PromptItem
from ..llm import build_tokenizer, compute_dtype, load_model
from ..llm.placement import (
    offload_module,
    onload_module,
    set_torch_threads,
    split_evenly,
    torch_device,
)
from ..scoring.evaluation import greedy_scores
from ..scoring.functions import RewardFunction
from .engines import ROLLOUT_ENGINES


class RolloutWorker(Worker):
    """Generates GRPO groups: ``n_samples`` responses per prompt (HF ``generate``, KV cache).

    Args:
        model: :class:`~m2flow.workers.llm.ModelConfig` fields: a Hugging Face directory
            (``path``) or a shape (weights arrive by ``m2flow.sync_weights(actor, rollout)``),
            ``dtype``.
        tokenizer: the tokenizer spec, ``{"name": "char", "alphabet": str}`` or
            ``{"name": "qwen2"}`` (:func:`~m2flow.workers.llm.build_tokenizer`).
        n_samples: responses per prompt (GRPO group size).
        max_new_tokens: response cap in tokens (EOS included).
        temperature, top_p: sampling parameters.
        heldout: the held-out prompts :meth:`evaluate` decodes (ranks take shards).
        reward: :class:`~..scoring.functions.RewardFunction` arguments: how :meth:`evaluate`
            scores (default: ``auto``).
        shared_prefix: prefill each prompt once for its ``n_samples`` samples
            (:func:`.generation.prefill_shared`) instead of once per sample.
        threads: torch intra-op threads; 0 = this rank's share of its node's CPUs.
        spot: :class:`~m2flow.workers.rollout.spot.config.SpotPoolConfig` fields: with ``enabled``,
            each step's rollout goes through the spot rollout pool (RLBoost; docs/results/spot.md):
            this rank seeds for ``T_seed`` seconds, spot instances continue.
        seed: the run seed: token ``t`` of sample ``j`` of prompt ``p`` in step ``s`` is drawn
            from a counter keyed by ``(seed, s, p, j, t)`` (:mod:`~..llm.sampling`), so responses do
            not depend on the rank, chunk or plan that generated them.
        engine: ``"hf"`` (transformers ``generate``, the default) or ``"vllm"``
            (:class:`~.vllm_engine.VllmEngine`, in-process vLLM CPU; docs/results/vllm.md): it
            samples and takes weight updates; ``self.model`` still holds the weights for
            :meth:`evaluate`. With ``spot`` the pool runs vLLM too: block-wise continuation
            (:meth:`~.vllm_engine.VllmEngine.step`) on this rank and on every spot instance
            (not with ``spot.engine="emulated"``, which models the engine instead).
    """

    def __init__(
        self,
        model: dict,
        tokenizer: dict,
        n_samples: int = 16,
        max_new_tokens: int = 6,
        temperature: float = 0.7,
        top_p: float = 1.0,
        heldout: list[PromptItem] | None = None,
        reward: dict | None = None,
        shared_prefix: bool = True,
        threads: int = 0,
        spot: dict | None = None,
        seed: int = 0,
        engine: str = "hf",
    ) -> None:
        spot_on = bool(spot and spot.get("enabled"))
        if engine == "vllm" and spot_on and spot.get("engine", "exact") != "exact":
            raise ValueError(
                f"engine='vllm' with rollout.spot.engine={spot.get('engine')!r}: the emulated "
                "engine models the rollout engine; use rollout.engine=hf with it"
            )
        build = ROLLOUT_ENGINES.get(engine, "rollout")
        if not getattr(build, "generates", False):
            raise ValueError(
                f"rollout.engine={engine!r} continues blocks for the spot pool only "
                f"(rollout.spot.engine): pick an engine that samples whole groups, hf or vllm"
            )
        set_torch_threads(self, threads)
        self.device = torch_device(self.devices)
        self.tokenizer = build_tokenizer(tokenizer)
        # Weights in model.dtype (inference only); sync_weights casts the actor's into them.
        self.model = load_model(model, self.tokenizer, self.device).eval()
        self.n_samples, self.max_new_tokens = n_samples, max_new_tokens
        self.temperature, self.top_p = temperature, top_p
        self.heldout = heldout
        self.reward = RewardFunction(**(reward or {}))
        self.seed = seed
        args = {
            "model": model, "temperature": temperature, "top_p": top_p, "seed": seed,
            "shared_prefix": shared_prefix,
            "dtype": str(compute_dtype(model.get("dtype", "auto"), self.device)).split(".")[-1],
            "min_new_tokens": spot.get("min_new_tokens", 0) if spot_on else 0,
        }  # fmt: skip
        self.engine = build(args, self.model, self.tokenizer)
        self.model.to(self.device)  # (vLLM was built from a CPU copy)
        self.pool = None
        if spot_on:
            from .spot.pool import ReservedSeeder

            self.pool = ReservedSeeder(self, spot, model, tokenizer)

    @property
    def vllm(self):
        """The engine when it samples on its own copy of the weights (vLLM), else ``None``: the
        spot pool's reserved seeder continues blocks on it (:mod:`.spot.pool`)."""
        return self.engine if self.engine.model is None else None

    # -- generation -------------------------------------------------------------------------

    def generate(self, prompts: Channel, out: Channel, num_prompts: int) -> dict:
        """Take this rank's share of ``num_prompts`` prompts from ``prompts`` in chunks of the
        plan's granularity (:meth:`~m2flow.Worker.chunk_size`; the whole share without a
        plan); put one rollout chunk per prompt chunk into ``out``.

        A prompt item is ``{"prompt_ids": list[int], "group": int, "entry": dict}`` (the
        entry: :meth:`~..data.item.PromptItem.entry`, for the reward) plus optionally
        ``"step": int`` (the sampling key; 0 if absent); ``group`` is unique within
        the step. A rollout chunk is a :class:`~..chunk.RolloutChunk` (``batch [chunk *
        n_samples]``, ``entries`` by group, ``weight_version``, ``step``, ``step_samples``) put
        with weight = its token count; ``step_samples = num_prompts * n_samples`` is the number
        of responses the whole step will have (all ranks): a consumer may announce it before
        the step's last chunk (the reward service's batch-size hint,
        docs/results/reward_service.md).

        Returns:
            ``samples``, ``tokens`` (prompt + response), ``response_length`` (mean tokens).
        """
        share = split_evenly(num_prompts, self.world_size)[self.rank]
        step_samples = num_prompts * self.n_samples
        if self.pool is not None:
            return self.pool.generate(prompts.get_batch(share, max_items=share), out, step_samples)
        granularity = self.chunk_size(default=share)
        samples = tokens = resp_tokens = 0
        while share > 0:
            size = min(granularity, share)
            items = prompts.get_batch(size, max_items=size)
            share -= len(items)
            gen = self.engine.generate(
                [it["prompt_ids"] for it in items],
                n_samples=self.n_samples,
                max_new_tokens=self.max_new_tokens,
                sample_keys=[(it.get("step", 0), it["group"]) for it in items],
            )
            groups = torch.tensor([it["group"] for it in items], device="cpu")
            gen["group_index"] = groups[gen["group_index"]]
            batch = to_batch(gen)
            n_tok = num_tokens(batch)
            chunk = RolloutChunk(
                batch,
                entries={it["group"]: it["entry"] for it in items},
                weight_version=self.weight_version,
                step=items[0].get("step", 0),
                step_samples=step_samples,
            )
            out.put(chunk, weight=n_tok)
            samples += len(batch)
            tokens += n_tok
            resp_tokens += int(batch["response_mask"].sum())
        return {
            "samples": samples,
            "tokens": tokens,
            "response_length": resp_tokens / max(samples, 1),
        }

    # -- weights ----------------------------------------------------------------------------

    def load_weights(self, weights: dict, version: int) -> None:
        """Load the policy's weights in place (``m2flow.sync_weights``); with the spot pool,
        rank 0 also stages them for the spot instances to pull; with ``engine="vllm"`` the
        engine's copy is updated in place too."""
        self.model.load_state_dict(weights)  # the held-out evaluation's model
        if self.engine.model is not self.model:  # an engine with its own copy (vLLM)
            self.engine.load_weights(weights, version)
        if self.pool is not None and self.rank == 0:
            # Host copies of their own: cuda_ipc delivers views into the source's packed
            # buffers (pickling a view writes its whole storage), and spot nodes may lack CUDA.
            self.pool.stage({k: v.detach().cpu() for k, v in weights.items()}, version)

    # -- evaluation -------------------------------------------------------------------------

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
