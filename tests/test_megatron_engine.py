"""``actor.engine=megatron``: the GRPO actor on Megatron-core over gloo, virtual devices.

Real Ray (one session for the module), tiny Qwen2. Skipped without the ``megatron`` extra and on
a CUDA host (the CPU/gloo path is what this covers). One workflow run
(``workflows/grpo.py actor.engine=megatron actor.tensor_parallel=2``, the actor on 4 devices:
TP=2 x DP=2, mini-batches of 8 in micro-batches of 4) and, on its live groups:

- after each sync the rollout holds exactly the weights gathered here from the ranks' shards;
- the step's update equals the torch engine's on the same training data from the same weights
  (replayed here): loss within ``LOSS_ATOL``, weights within ``WEIGHT_ATOL`` (fp32 rounding;
  measured values in docs/megatron.md);
- the HF-layout checkpoint (plus one optimizer file per rank) restores shards and optimizer.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("megatron") is None or (
    importlib.util.find_spec("megatron.core") is None
):
    pytest.skip(
        "megatron-core not installed: pip install -c constraints.txt -e '.[megatron]'",
        allow_module_level=True,
    )

import torch  # noqa: E402
from m2flow.workers.actor.trainer import PolicyTrainer  # noqa: E402
from m2flow.workers.actor.worker import ActorWorker  # noqa: E402
from m2flow.workers.llm import build_char_tokenizer, build_model  # noqa: E402
from megatron_probes import ProbedRollout, ShardedActor  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_workflow import ALPHABET, GRPO, ROOT, TINY_MODEL, TINY_RUN, TOKENIZER, _records  # noqa: E402

from m2flow.config import ConfigError  # noqa: E402
from m2flow.placement import Placement  # noqa: E402
from m2flow.workflow import prepare, run_workflow  # noqa: E402

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(torch.cuda.is_available(), reason="covers the CPU/gloo Megatron path"),
]
VIRTUAL_DEVICES = 4  # the actor's TP=2 x DP=2
MODEL = {**TINY_MODEL, "num_key_value_heads": 2}  # TP=2 splits the KV heads
#: |loss_megatron - loss_torch| allowed: fp32 sums in another order (TP all-reduces, DP sums)
LOSS_ATOL = 1e-5
#: largest weight difference allowed after one step's AdamW updates (lr=1e-4): 10% of one
#: update (Adam's first update is lr * g / (|g| + eps): rounding in tiny gradients is amplified)
WEIGHT_ATOL = 1e-5
OVERRIDES = [
    "actor.engine=megatron",
    "actor.tensor_parallel=2",
    "model.num_key_value_heads=2",
    "warm_start.steps=150",  # mixed rewards within groups, so the steps train
    "trainer.steps=3",  # stopped after step 2 (max_steps), the groups kept for the checks
]


def _gather(shards: list[tuple[int, int, dict]]) -> dict:
    """HF-layout weights from the ranks' ``(tp_rank, dp_rank, state)`` (DP replica 0)."""
    from m2flow.workers.actor.megatron.convert import megatron_to_hf
    from m2flow.workers.actor.megatron.model import megatron_shape

    by_tp = {t: s for t, d, s in shards if d == 0}
    config = build_model(MODEL, build_char_tokenizer(ALPHABET)).config
    shape = megatron_shape(config, len(by_tp))
    return megatron_to_hf([by_tp[t] for t in sorted(by_tp)], shape)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _torch_engine_update(cfg, weights: dict, data: dict) -> tuple[dict, dict]:
    """The torch engine's update (``PolicyTrainer.train_on_batch``, as a one-rank torch actor
    with the run's actor config takes it) on ``data`` from ``weights``: metrics, new weights."""
    a = cfg.actor
    model = build_model(MODEL, build_char_tokenizer(ALPHABET))
    model.load_state_dict(weights)
    trainer = PolicyTrainer(
        model,
        lr=a.lr,
        betas=tuple(a.betas),
        weight_decay=a.weight_decay,
        grad_clip=a.grad_clip,
        temperature=cfg.rollout.temperature,
        clip_eps_low=a.clip_eps_low,
        clip_eps_high=a.clip_eps_high,
        shared_prefix=a.shared_prefix,
    )
    metrics = trainer.train_on_batch(data, a.mini_batch_size or None, a.micro_batch_size or None)
    return metrics, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_workflow_tp2_dp2_syncs_matches_torch_engine_and_restores(tmp_path, monkeypatch, cluster):
    """``m2flow run workflows/grpo.py actor.engine=megatron actor.tensor_parallel=2`` with the
    actor on devices 0-3 (one rank each; rank 0 time-shares device 0 with the rollout and the
    reward: offload and onload run), 2 GRPO steps; then the checks of the module docstring."""
    import m2flow.workers.actor.worker as actor_module
    import m2flow.workers.rollout.worker as rollout_module

    monkeypatch.setattr(actor_module, "ActorWorker", ShardedActor)  # main imports them by name
    monkeypatch.setattr(rollout_module, "RolloutWorker", ProbedRollout)
    run_dir = tmp_path / "run"
    overrides = TINY_RUN + OVERRIDES + [f"trainer.run_dir={run_dir}"]
    plan = Placement(mode="hybrid", groups={"rollout": [0], "reward": [0], "actor": [0, 1, 2, 3]})
    cfg = prepare(str(GRPO), overrides)[1]  # the replay's settings
    session = run_workflow(GRPO, overrides, plan=plan, max_steps=2, keep_cluster=True)
    try:
        groups = {g.name: g for g in session.cluster.groups}
        actor, rollout = groups["actor"], groups["rollout"]
        assert session.groups["actor"] == [[0], [1], [2], [3]]
        assert session.weight_versions == {"rollout": 2}
        records = _records(run_dir)
        assert [r["step"] for r in records] == [0, 1, 2]
        assert records[1]["grad_norm"] > 0  # step 1 trained: the replay below tests something

        # Each sync: the rollout got exactly the shards, gathered; now and after step 1.
        now = _gather(actor.shard().wait(60))
        assert _equal(rollout.weights(2).wait(60)[0], now)
        # Step 1 replayed on the torch engine: same loss, same weights (the rollout's v1).
        data = actor.on(0).training_data(0).wait(60)[0]
        before, after = (rollout.weights(v).wait(60)[0] for v in (0, 1))
        metrics, want = _torch_engine_update(cfg, before, data)
        loss_diff = abs(records[1]["loss"] - metrics["loss"])
        weight_diff = max(float((after[k] - want[k]).abs().max()) for k in want)
        moved = max(float((after[k] - before[k]).abs().max()) for k in want)
        steps = metrics["steps"]
        print(f"megatron TP2xDP2 vs torch engine: |loss| {loss_diff:.3g}, |weights| "
              f"{weight_diff:.3g} (largest change {moved:.3g}, {steps} steps)")  # fmt: skip
        assert metrics["steps"] >= 1 and moved > 1e-5
        assert loss_diff <= LOSS_ATOL and weight_diff <= WEIGHT_ATOL

        # The step-2 checkpoint: HF layout = the synced weights; it restores shards and moments.
        ckpt = run_dir / "checkpoints" / "step_000002" / "actor"
        saved = load_file(ckpt / "model.safetensors")
        assert all(torch.equal(saved[k], now[k]) for k in saved)
        moments = actor.optimizer_state().wait(60)
        actor.scramble().wait(60)
        assert actor.load_checkpoint(str(ckpt)).wait(60) == [2] * 4
        assert _equal(_gather(actor.shard().wait(60)), now)
        for got, want_state in zip(actor.optimizer_state().wait(60), moments):
            assert got["state"].keys() == want_state["state"].keys()
            for i, st in want_state["state"].items():
                assert all(torch.equal(got["state"][i][k], v) for k, v in st.items())
    finally:
        session.cluster.shutdown()


def test_bad_megatron_settings_are_refused_at_launch(cluster):
    """Before any process starts, with the setting to change named."""
    kw = dict(model=MODEL, tokenizer=TOKENIZER, threads=1, engine="megatron")
    cases = [
        (dict(tensor_parallel=2, pipeline_parallel=2), "actor.pipeline_parallel=1"),
        (dict(tensor_parallel=4), "actor.tensor_parallel=4 must divide"),
        (dict(tensor_parallel=2, model=TINY_MODEL), "num_key_value_heads=1"),
        (dict(tensor_parallel=2, kl_coef=0.1), "actor.kl_coef=0"),
    ]
    for extra, match in cases:
        with pytest.raises(ValueError, match=match):
            ActorWorker.launch(cluster, [0, 1], name="actor_bad", **{**kw, **extra})
    with pytest.raises(ValueError, match="actor.engine"):
        ActorWorker.launch(cluster, [0], name="actor_bad", model=MODEL, tokenizer=TOKENIZER,
                           engine="jax")  # fmt: skip
    with pytest.raises(ValueError, match="actor.tensor_parallel"):
        ActorWorker.launch(cluster, [0], name="actor_bad", model=MODEL, tokenizer=TOKENIZER,
                           tensor_parallel=2)  # fmt: skip
    assert not [g for g in cluster.groups if g.name == "actor_bad"]


@pytest.mark.parametrize(
    ("workflow", "override", "match"),
    [
        ("grpo", "actor.engine=jax", "actor.engine must be torch or megatron"),
        ("grpo", "actor.tensor_parallel=2", "actor.engine=megatron"),
        ("grpo", "actor.pipeline_parallel=2", "actor.pipeline_parallel must be 1"),
        ("ppo", "actor.engine=megatron", "PPO runs on the torch engine"),
        ("ppo", "critic.engine=megatron", "critic.engine=torch"),
    ],
)
def test_bad_engine_config_is_a_config_error(tmp_path, workflow, override, match):
    """Refused by the workflow's checks, before a cluster starts."""
    path = ROOT / "workflows" / f"{workflow}.py"
    with pytest.raises(ConfigError, match=match):
        prepare(str(path), [override, f"trainer.run_dir={tmp_path}"])
