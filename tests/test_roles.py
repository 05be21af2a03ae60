"""What the roles compose, without Ray: the actor's typed options, the workflows' role sections
as the roles' options, the rollout's options as its engines check them, the step's batch in a
fixed order, the reference's logprob-only engine (the actor's logprob function,
micro-batched)."""

from __future__ import annotations

import pytest
import torch
from m2flow.workers.actor.config import ActorOptions, ReferenceOptions
from m2flow.workers.algos.logprobs import sequence_logprobs
from m2flow.workers.algos.losses import make_loss
from m2flow.workers.chunk import RolloutChunk, step_batch, timed
from m2flow.workers.embodied.config import EnvOptions, PolicyOptions, PPOOptions
from m2flow.workers.engines.registry import engine_class
from m2flow.workers.engines.torch_engine import TorchEngine
from m2flow.workers.llm import build_char_tokenizer, build_model
from m2flow.workers.llm.generation import generate
from m2flow.workers.reward.config import RewardModelOptions
from m2flow.workers.rollout.config import RolloutOptions
from m2flow.workers.rollout.engines import check_rollout
from m2flow.workers.rollout.spot.config import SpotPoolConfig
from tensordict import TensorDict

from m2flow.core.config import ConfigError, load_config
from m2flow.run.recipe import options
from m2flow.run.workflow import load_workflow, resolve_workflow

TINY = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def test_actor_options_typed_and_checked():
    opt = ActorOptions.from_kwargs({"lr": 3e-4, "betas": [0.9, 0.95], "mini_batch_size": 8})
    assert opt.betas == (0.9, 0.95) and opt.mini == 8 and opt.micro is None
    optim = opt.optim(torch.bfloat16)
    assert optim["lr"] == 3e-4 and optim["compute_dtype"] is torch.bfloat16
    engine = TorchEngine.from_module(torch.nn.Linear(2, 2), **optim)  # the engine's settings
    assert engine.nonfinite == "stop" and engine.grad_clip == 1.0
    # The loss's settings are the loss's: the engine takes none of them.
    assert not set(opt.loss_settings) & set(optim) - {"kl_coef"}
    loss = make_loss(opt.loss, "policy", **opt.loss_settings)
    assert loss.name == "grpo" and loss.settings["clip_eps_high"] == 0.28
    with pytest.raises(ValueError, match="has no option lrr, mini_batch: its options are"):
        ActorOptions.from_kwargs({"lrr": 1.0, "mini_batch": 2})
    with pytest.raises(ValueError, match="actor.nonfinite='maybe': pick stop or skip"):
        ActorOptions.from_kwargs({"nonfinite": "maybe"})
    with pytest.raises(ValueError, match="actor.nonfinite='maybe'"):
        ActorOptions(nonfinite="maybe")  # built directly: checked the same
    with pytest.raises(ValueError, match="loss 'ppg': pick one of grpo, gspo"):
        make_loss("ppg", "policy")


def _chunk(gid: int, version: int, rows: int = 2) -> RolloutChunk:
    batch = TensorDict(
        {"group_index": torch.full((rows,), gid), "prompt_ids": torch.ones(rows, gid % 3 + 1)},
        batch_size=[rows],
    )
    return RolloutChunk(batch, entries={gid: {}}, weight_version=version)


@pytest.mark.parametrize(
    "workflow, section, cls",
    [
        ("ppo", "reference", ReferenceOptions),
        ("ppo", "reward_model", RewardModelOptions),
        ("ppo", "rollout", RolloutOptions),
        ("grpo", "rollout", RolloutOptions),
        ("embodied", "env", EnvOptions),
        ("embodied", "policy", PolicyOptions),
        ("embodied", "algorithm", PPOOptions),
    ],
)
def test_workflow_section_is_the_roles_options(workflow, section, cls):
    """The section a workflow's config has for a role is that role's options class (its
    defaults written there once), handed to the role whole; a typo in it is refused."""
    config = load_workflow(resolve_workflow(workflow)).Config
    opt = options(getattr(load_config(config, [f"{section}.threads=3"]), section))
    assert type(opt) is cls and opt.threads == 3
    with pytest.raises(ConfigError, match=f"unknown config key '{section}.thread'"):
        load_config(config, [f"{section}.thread=3"])
    with pytest.raises(ConfigError, match=f"bad value for '{section}.threads'"):
        load_config(config, [f"{section}.threads=many"])


def test_rollout_options_asked_of_the_engine():
    """The rollout role's options as its launch hands them to the engines' checks
    (:func:`check_rollout`): the spot pool's own settings when it is on, the configured engine's
    otherwise; a direct launch's ``spot`` dict becomes the pool's config."""
    model = {**TINY, "dtype": "float32"}
    opt = RolloutOptions(spot={"enabled": True, "theta": 0})
    assert isinstance(opt.spot, SpotPoolConfig) and opt.spot.theta == 0
    with pytest.raises(ValueError, match="rollout.spot.theta must be >= 1"):
        check_rollout(opt.engine_check(model), 1)
    assert check_rollout(RolloutOptions().engine_check(model), 1) is engine_class("rollout", "hf")
    with pytest.raises(ValueError, match="rollout.engine='exact' continues blocks"):
        check_rollout(RolloutOptions(engine="exact").engine_check(model), 1)
    # vLLM's own check reads the model: a head dimension of 8 is refused
    with pytest.raises(ValueError, match="rollout.engine=vllm: vLLM's CPU attention"):
        check_rollout(RolloutOptions(engine="vllm").engine_check(model), 1)
    spot = {"enabled": True, "engine": "emulated"}
    with pytest.raises(
        ValueError, match="models the rollout engine: use it with rollout.engine=hf"
    ):
        check_rollout(RolloutOptions(engine="vllm", spot=spot).engine_check(model), 1)


def test_step_batch_orders_by_key_and_counts_stale():
    batch, stale = step_batch([_chunk(9, 2), _chunk(4, 3, rows=3)], pad_token_id=0, version=3)
    assert batch["group_index"].tolist() == [4, 4, 4, 9, 9]  # by key, not by arrival
    assert stale == 2 and batch["prompt_ids"].shape == (5, 2)  # left padded to the longest
    waits: list = []
    assert list(timed(iter("ab"), waits)) == ["a", "b"]
    assert len(waits) == 3 and all(t1 >= t0 for t0, t1 in waits)  # the end of stream too


def test_logprob_engine_is_the_actors_function(tmp_path):
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = build_model(TINY, tok, seed=1)
    prompts = [tok(p).input_ids for p in ["12+3=", "1-1=", "99+1-5="]]
    out = generate(model, tok, prompts, n_samples=2, max_new_tokens=4, seed=3)
    engine = engine_class("logprob", "torch", "reference")(
        TINY, tok, device=torch.device("cpu"), temperature=0.7, micro_batch_size=4
    )
    engine.load_state_dict(model.state_dict())
    keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
    batch = TensorDict({k: out[k] for k in keys}, batch_size=[len(out["response_ids"])])
    got = engine.logprobs(batch)
    with torch.no_grad():
        want = sequence_logprobs(model, *(out[k] for k in keys), temperature=0.7)
    assert got.shape == want.shape == out["response_ids"].shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert not any(p.requires_grad for p in engine.model.parameters())  # frozen
    with pytest.raises(ValueError, match="reference.engine='fsdp'"):
        engine_class("logprob", "fsdp", "reference")
