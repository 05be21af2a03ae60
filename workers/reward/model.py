"""Reward-model worker: a small LM with a scalar head, mixed with the run's verifier.

Many RLHF setups score with a learned reward model and mix in a rule-based check where one
exists. The reward model is either your own (``reward_model.path``: a Hugging Face
sequence-classification directory with one label, used as it is, never fitted) or, by default,
fitted here. The *verifier* here is the run's reward function (``reward.function``:
:class:`~.functions.RewardFunction`; by default reasoning-gym's scorer for reasoning-gym
prompts). The learned part starts from the warm-started policy's transformer and is fitted
briefly (:meth:`RewardModelWorker.fit`) to verifier labels of the policy's own samples: binary
cross-entropy towards the verifier's score (InstructGPT section 3.5 fits to human
comparisons instead; no humans here). The reward of a sample is then
``w * verifier + (1 - w) * sigmoid(rm_logit)`` (in [0, 1] for a verifier in [0, 1]).
"""

from __future__ import annotations

import torch
from m2flow.scheduler.runtime.balance import all_queued

from m2flow import Channel, Worker, group_method

from ..algos.losses import make_loss, sequence_scores
from ..batch import concat, num_tokens
from ..checkpoint import load_state, save_state
from ..chunk import RolloutChunk
from ..engines.registry import engine_class
from ..engines.torch_engine import refuse_nonfinite
from ..llm import build_tokenizer
from ..llm.placement import set_torch_threads, torch_device
from ..llm.tokenizer import decode_responses
from ..scoring.functions import RewardFunction, RewardResult, result_metrics
from ..tasks import accuracy
from .config import RewardModelOptions


def check_reward_model(path: str, tokenizer: dict) -> None:
    """Before anything starts: ``path`` is a one-label sequence classifier
    (:func:`~..engines.value_model.check_classifier`) whose tokenizer files, if it has any, have the
    policy's vocabulary (the reward model scores the policy's token ids as they are).

    Args:
        tokenizer: the policy's tokenizer spec.

    Raises:
        FileNotFoundError, ValueError: the first problem, with the fix.
    """
    from ..engines.value_model import check_classifier
    from ..llm.tokenizer import build_pretrained_tokenizer

    check_classifier(path)
    try:
        own = build_pretrained_tokenizer(path)
    except FileNotFoundError:
        return  # no tokenizer files: it is taken to be the policy's
    if own.get_vocab() != build_tokenizer(tokenizer).get_vocab():
        raise ValueError(
            f"reward_model.path={path}: its tokenizer's vocabulary differs from the policy's; "
            "the reward model scores the policy's token ids as they are: use a reward model "
            "trained with the policy's tokenizer"
        )


def check_reward_engine(engine: str, config: dict) -> type:
    """The reward model's value engine class, asked whether it runs ``config`` (the
    ``reward_model`` section, ``model`` included) on the role's one rank.

    Raises:
        ValueError: an unknown engine, one that runs one rank per device, or a setting its
            ``check`` refuses.
    """
    cls = engine_class("value", engine, "reward_model")
    if cls.one_rank_per_device:
        raise ValueError(
            f"reward_model.engine={engine} runs one rank per device; the reward model runs "
            "one rank (its fit would diverge across ranks): use reward_model.engine=torch"
        )
    cls.check(config, 1, "reward_model")
    return cls


class RewardModelWorker(Worker):
    """Scores rollout chunks: learned reward model plus verifier.

    One rank (``data_parallel = False``): :meth:`fit` trains, and ranks would diverge.

    Args:
        model: :class:`~m2flow.workers.llm.ModelConfig` fields (the policy's shape).
        tokenizer: the tokenizer spec, ``{"name": "char", "alphabet": str}`` or
            ``{"name": "qwen2"}`` (:func:`~m2flow.workers.llm.build_tokenizer`).
        options: the workflow's ``reward_model`` section (:class:`~.config.RewardModelOptions`):
            ``verifier_weight``, ``w`` in the mix (1: verifier only, 0: reward model only);
            ``lr``, ``grad_clip``: AdamW for :meth:`fit`; ``batch_size``: samples per fit
            step; ``micro_batch_size``: samples per scoring forward; ``threads``: torch
            threads (0: the CPUs of the rank's devices); ``path``: a pretrained reward model
            (:meth:`~..engines.value_model.ValueModel.from_classifier`; it scores the policy's
            token ids, so it must share the policy's tokenizer), used as it is (no
            :meth:`fit`, no weights from the policy); None: the policy's transformer with a
            new head, fitted by :meth:`fit`; ``engine``: a value engine (kind ``value``,
            :mod:`~..engines.registry`) that runs on one rank: ``torch`` or an import path
            (``megatron`` runs one rank per device).
        seed: init and shuffling.
        reward: the verifier: :class:`~.functions.RewardFunction` arguments (``function``,
            ``on_error``, ``penalty``; default ``auto``).

    Raises:
        ValueError: ``verifier_weight`` outside [0, 1]; an unknown ``engine`` or one that
            runs one rank per device, or a setting it refuses (its ``check``).
    """

    data_parallel = False

    def __init__(
        self,
        model: dict,
        tokenizer: dict,
        options: RewardModelOptions,
        seed: int = 0,
        reward: dict | None = None,
    ) -> None:
        o = self.options = options
        if not 0.0 <= o.verifier_weight <= 1.0:
            raise ValueError(f"verifier_weight must be in [0, 1], got {o.verifier_weight}")
        path, micro_batch_size = o.path, o.micro_batch_size
        engine_cls = check_reward_engine(o.engine, {"model": model, "path": path})
        set_torch_threads(self, o.threads)
        self.tokenizer = build_tokenizer(tokenizer)
        self.reward_fn = RewardFunction(**(reward or {}))
        self._results: list[RewardResult] = []  # this call's, for its metrics
        self.pretrained = bool(path)
        # a value engine (the critic's kind), fitted here as a reward model
        self.engine = engine_cls(
            model, self.tokenizer, device=torch_device(self.devices), seed=seed,
            optim={"lr": o.lr, "grad_clip": o.grad_clip}, classifier=path,
        )  # fmt: skip
        self.loss = make_loss("score_bce", "score")
        self.w, self.batch_size = o.verifier_weight, o.batch_size
        self.micro = micro_batch_size or None
        self.generator = torch.Generator().manual_seed(seed)

    def load_weights(self, weights: dict, version: int) -> None:
        """Start from the policy's transformer (``m2flow.sync_weights(actor, reward)``).

        Raises:
            ValueError: a pretrained reward model (``path``), which keeps its own weights.
        """
        if self.pretrained:
            raise ValueError("a pretrained reward model (reward_model.path) keeps its weights")
        self.engine.load_backbone(weights)

    def _verify(self, chunk: RolloutChunk) -> torch.Tensor:
        batch = chunk.batch
        texts = decode_responses(self.tokenizer, batch["response_ids"], batch["response_mask"])
        res = self.reward_fn(texts, chunk.row_entries())
        self._results.append(res)
        return torch.tensor(res.scores, dtype=torch.float32)

    @group_method(collect="rank0")
    def fit(self, inp: Channel, heldout_prompts: int, epochs: int) -> dict:
        """Fit the reward model to verifier labels of the rollout chunks read from ``inp``
        (until the rollout's end of step): the samples of the last ``heldout_prompts``
        prompts (by prompt id) measure it, before and after; the others train it (``epochs``
        shuffled passes, ``batch_size`` samples a step).

        Returns:
            ``rm_train_samples``, ``rm_heldout_samples``, ``rm_label_mean`` (mean verifier
            score of the training samples), ``rm_loss`` (last step, nats), and on the held-out
            samples before/after fitting: ``rm_corr_*`` (Pearson correlation of the score with
            the verifier's) and ``rm_auc_*`` (probability that a fully correct sample scores
            above an incorrect one; NaN without both kinds).

        Raises:
            ValueError: no prompt left to train on; a pretrained reward model (``path``).
        """
        if self.pretrained:
            raise ValueError("a pretrained reward model (reward_model.path) is not fitted")
        chunks = sorted(
            (c for part in inp.stream(balance=all_queued, target_weight=1) for c in part),
            key=lambda c: c.key,
        )
        pad = self.tokenizer.pad_token_id
        batch = concat([c.batch for c in chunks], pad)
        labels = torch.cat([self._verify(c) for c in chunks])
        prompts = batch["group_index"]
        n_prompts = int(prompts.max()) + 1 if len(prompts) else 0
        if not 0 <= heldout_prompts < n_prompts:
            raise ValueError(f"heldout_prompts must be in [0, {n_prompts}), got {heldout_prompts}")
        is_held = prompts >= n_prompts - heldout_prompts
        train = {k: v[~is_held] for k, v in batch.items()}
        y = labels[~is_held]
        held = {k: v[is_held] for k, v in batch.items()} if heldout_prompts else None
        y_held = labels[is_held] if heldout_prompts else None
        out = {"rm_train_samples": len(y), "rm_label_mean": float(y.mean())}
        if held is not None:
            out |= _quality(self._scores(held), y_held, "before")
        loss = float("nan")
        for _ in range(epochs):
            for idx in torch.split(
                torch.randperm(len(y), generator=self.generator), self.batch_size
            ):
                loss = self._fit_step({k: v[idx] for k, v in train.items()}, y[idx])
        out["rm_loss"] = loss
        if held is not None:
            out |= _quality(self._scores(held), y_held, "after")
            out["rm_heldout_samples"] = len(y_held)
        # Frozen from here on: drop the optimizer moments.
        self.engine.reset_optimizer()
        return out

    def _fit_step(self, batch: dict, targets: torch.Tensor) -> float:
        """One optimizer step of :func:`~..algos.losses.score_bce_loss` towards ``targets``
        ``[B]`` (one forward over the batch); returns the loss."""
        data = {**batch, "targets": targets}
        (record,) = self.engine.forward_backward(data, self.loss, None, float(len(targets)))
        self.engine.optimizer_step()
        return record["loss"]

    def _scores(self, batch: dict) -> torch.Tensor:
        """``[B]`` sequence scores in (0, 1): the sigmoid of the head's score (no grad)."""
        return self.engine.infer(batch, _sigmoid_scores, self.micro)

    @group_method(collect="rank0")
    def score(self, inp: Channel, out: Channel) -> dict:
        """Score the step's rollout chunks from ``inp`` (until the rollout's end of step); put
        ``{"scores": [B],
        "verifier": [B], "rm": [B]}`` into ``out`` under each chunk's key.

        Returns:
            means of the mixed reward (``reward_mean``), of the verifier score
            (``verifier_mean``) and of the reward-model score (``rm_mean``); ``accuracy``
            (share of samples the verifier scores 1); ``samples``; ``reward_errors`` and
            ``reward_metrics`` (:func:`~.functions.result_metrics`).
        """
        mixed, ver, rm = [], [], []
        self._results = []
        for (chunk,) in inp.stream():
            batch = chunk.batch
            v = self._verify(chunk)
            r = self._scores(batch)
            s = self.w * v + (1.0 - self.w) * r
            out.put({"scores": s}, weight=num_tokens(batch), key=chunk.key)
            mixed.append(s)
            ver.append(v)
            rm.append(r)
        v_all = torch.cat(ver)
        return {
            "reward_mean": float(torch.cat(mixed).mean()),
            "verifier_mean": float(v_all.mean()),
            "rm_mean": float(torch.cat(rm).mean()),
            "accuracy": accuracy(v_all.tolist()),
            "samples": len(v_all),
            **result_metrics(self._results),
        }

    @group_method
    def save_checkpoint(self, path: str) -> str:
        """The fitted reward model and the shuffling RNG under ``path``."""
        refuse_nonfinite(self.engine, "reward model")
        return save_state(
            path,
            self.rank,
            {"model": self.engine.model.state_dict(), "generator": self.generator.get_state()},
        )

    @group_method
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""
        state = load_state(path, self.rank)
        self.engine.load_state_dict(state["model"])
        self.generator.set_state(state["generator"])

    def offload(self) -> None:
        self.engine.offload()

    def onload(self) -> None:
        self.engine.onload()


def _sigmoid_scores(out: torch.Tensor, mb: dict) -> torch.Tensor:
    return torch.sigmoid(sequence_scores(out, mb))


def _quality(pred: torch.Tensor, label: torch.Tensor, tag: str) -> dict[str, float]:
    """Pearson correlation and the correct-vs-incorrect AUC of ``pred`` against ``label``."""
    corr = float("nan")
    if pred.std() > 0 and label.std() > 0:
        corr = float(torch.corrcoef(torch.stack([pred, label]))[0, 1])
    pos, neg = pred[label == 1.0], pred[label < 1.0]
    auc = float("nan")
    if len(pos) and len(neg):
        diff = pos.unsqueeze(1) - neg.unsqueeze(0)
        auc = float((diff > 0).float().mean() + 0.5 * (diff == 0).float().mean())
    return {f"rm_corr_{tag}": corr, f"rm_auc_{tag}": auc}
