"""``actor.engine=megatron``: the GRPO actor on Megatron-core over gloo, virtual devices.

Real Ray (one session for the module), tiny Qwen2. Skipped without the ``megatron`` extra and on
a CUDA host (the CPU/gloo path is what this covers). Two workflow runs, the actor on 4 devices,
mini-batches of 8 in micro-batches of 4: ``workflows/grpo.py actor.engine=megatron
actor.tensor_parallel=2`` (TP=2 x DP=2), and ``actor.pipeline_parallel=2 actor.kl_coef=1``
on a 2-layer model (TP=1 x PP=2 x DP=2, Megatron's pipeline schedule, a frozen reference shard
for the k3 KL term); on each one's live groups:

- after each sync the rollout holds exactly the weights gathered here from the ranks' shards;
- the two steps' updates equal the torch engine's on the same training data from the same
  weights (replayed here, AdamW state carried over; with KL the reference is the warm start):
  losses within ``LOSS_ATOL``, weights within ``WEIGHT_ATOL`` (fp32 rounding; measured values
  in docs/results/megatron.md);
- the HF-layout checkpoint (plus one optimizer file per rank) restores shards and optimizer,
  and the reference shard (= the warm-started weights) with KL on.
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
from m2flow.workers.actor.config import ActorOptions  # noqa: E402
from m2flow.workers.actor.worker import ActorWorker  # noqa: E402
from m2flow.workers.engines.torch_engine import TorchEngine  # noqa: E402
from m2flow.workers.llm import build_char_tokenizer, build_model  # noqa: E402
from megatron_probes import ProbedRollout, ShardedActor  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_workflow import ALPHABET, GRPO, ROOT, TINY_MODEL, TINY_RUN, TOKENIZER, _records  # noqa: E402

from m2flow.core.config import ConfigError  # noqa: E402
from m2flow.core.placement import Placement  # noqa: E402
from m2flow.run.workflow import prepare, run_workflow  # noqa: E402

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
    "data.shuffle=false",  # the split's first prompts: step 1 has mixed groups (shuffled: none)
    "trainer.steps=3",  # stopped after step 2 (max_steps), the groups kept for the checks
]


def _gather(shards: list[tuple[int, int, int, dict]], model: dict = MODEL) -> dict:
    """HF-layout weights from the ranks' ``(tp_rank, pp_rank, dp_rank, state)`` (DP replica
    0): stages merged, TP shards gathered."""
    from m2flow.workers.engines.megatron.convert import megatron_to_hf, merge_pipeline_stages
    from m2flow.workers.engines.megatron.model import megatron_shape

    mine = {(t, p): s for t, p, d, s in shards if d == 0}
    tp, pp = 1 + max(t for t, _ in mine), 1 + max(p for _, p in mine)
    config = build_model(model, build_char_tokenizer(ALPHABET)).config
    shape = megatron_shape(config, tp)
    layers = [shape.num_layers // pp] * pp
    merged = [merge_pipeline_stages([mine[t, p] for p in range(pp)], layers) for t in range(tp)]
    return megatron_to_hf(merged, shape)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _torch_engine_replay(cfg, model: dict, weights: list[dict], data: list[dict]) -> list:
    """The torch engine's updates (as a one-rank torch actor with the run's actor config takes
    them, AdamW state carried over) of steps 1, 2, ... on ``data[v]`` (what the step from weight
    version ``v`` trained on) from ``weights[0]`` (the warm start). With ``actor.kl_coef > 0``
    the reference is ``weights[0]`` (the torch actor freezes the warm-started policy) and its
    logprobs are computed as the torch actor does (the engine's ``infer`` on the frozen copy).

    Returns:
        per step ``(metrics, weights after it)``.
    """
    from test_llm import loss_args, train_on_batch

    a = cfg.actor
    policy = build_model(model, build_char_tokenizer(ALPHABET))
    policy.load_state_dict(weights[0])
    engine = TorchEngine.from_module(
        policy,
        lr=a.lr,
        betas=tuple(a.betas),
        weight_decay=a.weight_decay,
        grad_clip=a.grad_clip,
        temperature=cfg.rollout.temperature,
        kl_coef=a.kl_coef,
        shared_prefix=a.shared_prefix,
    )
    micro = a.micro_batch_size or None
    args = loss_args({"clip_eps_low": a.clip_eps_low, "clip_eps_high": a.clip_eps_high,
                      "kl_coef": a.kl_coef})  # fmt: skip
    out = []
    for step in data:
        metrics = {"loss": 0.0, "steps": 0}
        if len(step["advantages"]):  # the actor trains only on a non-empty batch
            if a.kl_coef > 0:
                step = dict(step, ref_logprobs=engine.infer(step, None, micro, reference=True))
            metrics = train_on_batch(engine, step, a.mini_batch_size or None, micro, **args)
        out.append((metrics, {k: v.detach().clone() for k, v in policy.state_dict().items()}))
    return out


def _run_and_check(tmp_path, monkeypatch, overrides: list[str], model: dict, label: str):
    """Run the workflow with ``overrides``, the actor on devices 0-3 (one rank each; rank 0
    time-shares device 0 with the rollout and the reward: offload and onload run), 2 GRPO
    steps; then the checks of the module docstring. Returns the differences measured."""
    import m2flow.workers.actor.worker as actor_module
    import m2flow.workers.rollout.worker as rollout_module

    monkeypatch.setattr(actor_module, "ActorWorker", ShardedActor)  # main imports them by name
    monkeypatch.setattr(rollout_module, "RolloutWorker", ProbedRollout)
    run_dir = tmp_path / "run"
    overrides = TINY_RUN + overrides + [f"trainer.run_dir={run_dir}"]
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
        now = _gather(actor.shard().wait(60), model)
        assert _equal(rollout.weights(2).wait(60)[0], now)
        # Steps 1 and 2 replayed on the torch engine: same losses, same weights (the rollout's
        # v1, v2). Step 2 runs with the policy off the reference: the KL term is live there.
        data = [actor.on(0).training_data(v).wait(60)[0] for v in (0, 1)]
        synced = [rollout.weights(v).wait(60)[0] for v in (0, 1, 2)]
        replay = _torch_engine_replay(cfg, model, synced, data)
        loss_diff = max(abs(records[v]["loss"] - replay[v - 1][0]["loss"]) for v in (1, 2))
        weight_diff = max(
            float((synced[v][k] - replay[v - 1][1][k]).abs().max())
            for v in (1, 2)
            for k in synced[v]
        )
        moved = max(float((synced[1][k] - synced[0][k]).abs().max()) for k in synced[0])
        metrics = replay[-1][0]
        print(f"megatron {label} vs torch engine, 2 steps: |loss| {loss_diff:.3g}, |weights| "
              f"{weight_diff:.3g} (step 1 moved {moved:.3g}; step 2 kl "
              f"{metrics.get('kl', 0):.3g})")  # fmt: skip
        assert replay[0][0]["steps"] >= 1 and moved > 1e-5
        assert loss_diff <= LOSS_ATOL and weight_diff <= WEIGHT_ATOL

        # The step-2 checkpoint: HF layout = the synced weights; it restores shards and moments
        # (and the reference shard: the warm-started weights, the rollout's v0).
        ckpt = run_dir / "checkpoints" / "step_000002" / "actor"
        saved = load_file(ckpt / "model.safetensors")
        assert all(torch.equal(saved[k], now[k]) for k in saved)
        moments = actor.optimizer_state().wait(60)
        actor.scramble().wait(60)
        assert actor.load_checkpoint(str(ckpt)).wait(60) == [2] * 4
        assert _equal(_gather(actor.shard().wait(60), model), now)
        if cfg.actor.kl_coef > 0:
            assert _equal(_gather(actor.shard(True).wait(60), model), synced[0])
        for got, want_state in zip(actor.optimizer_state().wait(60), moments):
            assert got["state"].keys() == want_state["state"].keys()
            for i, st in want_state["state"].items():
                assert all(torch.equal(got["state"][i][k], v) for k, v in st.items())
        return metrics, loss_diff, weight_diff
    finally:
        session.cluster.shutdown()


def test_workflow_tp2_dp2_syncs_matches_torch_engine_and_restores(tmp_path, monkeypatch, cluster):
    """``m2flow run workflows/grpo.py actor.engine=megatron actor.tensor_parallel=2``: TP=2 x
    DP=2 (:func:`_run_and_check`)."""
    _run_and_check(tmp_path, monkeypatch, OVERRIDES, MODEL, "TP2xDP2")


def test_workflow_pp2_dp2_kl_matches_torch_engine_and_restores(tmp_path, monkeypatch, cluster):
    """``actor.pipeline_parallel=2 actor.kl_coef=1`` on a 2-layer model: TP=1 x PP=2 x DP=2
    (stages over Megatron's 1F1B schedule, tied embeddings summed over the first and last
    stage, micro-batches of 4 rows), with a k3 KL term against the frozen reference shard; the
    replay's loss includes the same KL term (:func:`_run_and_check`)."""
    model = {**TINY_MODEL, "num_hidden_layers": 2}
    overrides = [
        "actor.engine=megatron",
        "actor.pipeline_parallel=2",
        "actor.kl_coef=1.0",  # kl_coef * kl (~5e-5 at step 2) above LOSS_ATOL: the loss sees it
        "model.num_hidden_layers=2",
        "warm_start.steps=150",
        "data.shuffle=false",  # steps 1 and 2 both have mixed groups (shuffled: step 1 none)
        "trainer.steps=3",
    ]
    metrics, _, _ = _run_and_check(tmp_path, monkeypatch, overrides, model, "PP2xDP2 KL")
    # step 2 trained with a KL term large enough for the loss comparison to see it
    assert metrics["steps"] >= 1 and metrics["kl"] > LOSS_ATOL


def test_bad_megatron_settings_are_refused_at_launch(cluster):
    """Before any process starts, with the setting to change named."""
    kw = dict(tokenizer=TOKENIZER, name="actor_bad")
    cases = [
        (dict(tensor_parallel=2, pipeline_parallel=2), MODEL,
         "x actor.pipeline_parallel=2 must divide"),
        (dict(tensor_parallel=4), MODEL, "actor.tensor_parallel=4 must divide"),
        (dict(tensor_parallel=2), TINY_MODEL, "num_key_value_heads=1"),
        (dict(pipeline_parallel=2), MODEL, "model.num_hidden_layers=1 is not divisible"),
    ]  # fmt: skip
    for extra, model, match in cases:
        opt = ActorOptions(threads=1, engine="megatron", **extra)
        with pytest.raises(ValueError, match=match):
            ActorWorker.launch(cluster, [0, 1], model=model, options=opt, **kw)
    with pytest.raises(ValueError, match="actor.engine"):
        ActorWorker.launch(cluster, [0], model=MODEL, options=ActorOptions(engine="jax"), **kw)
    with pytest.raises(ValueError, match="actor.tensor_parallel"):
        ActorWorker.launch(cluster, [0], model=MODEL, options=ActorOptions(tensor_parallel=2),
                           **kw)  # fmt: skip
    assert not [g for g in cluster.groups if g.name == "actor_bad"]


@pytest.mark.parametrize(
    ("workflow", "override", "match"),
    [
        ("grpo", "actor.engine=jax", "actor.engine must be torch or megatron"),
        ("grpo", "actor.tensor_parallel=2", "actor.engine=megatron"),
        ("grpo", "actor.pipeline_parallel=2", "pipeline_parallel needs actor.engine=megatron"),
        ("grpo", "actor.engine=megatron,actor.pipeline_parallel=3", "num_hidden_layers=.* is not"),
        ("ppo", "actor.engine=jax", "actor.engine must be torch or megatron"),
        ("ppo", "critic.tensor_parallel=2", "critic.engine=megatron"),
    ],
)
def test_bad_engine_config_is_a_config_error(tmp_path, workflow, override, match):
    """Refused by the workflow's checks, before a cluster starts."""
    path = ROOT / "workflows" / f"{workflow}.py"
    with pytest.raises(ConfigError, match=match):
        prepare(str(path), [*override.split(","), f"trainer.run_dir={tmp_path}"])
