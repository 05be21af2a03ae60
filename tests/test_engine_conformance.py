"""Every registered engine against its kind's protocol (issue 31 item 2): each built-in backend
conforms; every one that builds on a CPU without an extra is built from a tiny model config and
each protocol method is called once; a class missing a method is refused, at registration and
at lookup (import path), with the class, the kind and the methods named; an engine given by
import path (``rollout.engine=tiny_rollout_engine:WrappedHfEngine``) passes the GRPO workflow's
config validation, which asks the engine (``check``), and the role's builder builds it.

No Ray: the roles' wiring is covered by their own tests; this is the engines' side of the seam.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from m2flow.workers.algos.losses import make_loss, response_values
from m2flow.workers.engines import registry
from m2flow.workers.llm import ModelConfig, build_char_tokenizer, build_model
from m2flow.workers.llm.generation import generate
from m2flow.workers.rollout.engines import build_rollout_engine
from m2flow.workers.rollout.exact import GenRequest
from tensordict import TensorDict

from m2flow.core.config import ConfigError
from m2flow.run.workflow import prepare

ROOT = Path(__file__).resolve().parents[1]
GRPO = ROOT / "workflows" / "grpo.py"
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 64}  # fmt: skip
ALPHABET = "0123456789+-="
PROMPTS = ["1+2=", "3+4="]
CPU = torch.device("cpu")

#: backends not built here, with the reason (their classes are still checked)
NOT_BUILT = {
    ("train", "megatron"): "one rank per device in a process group: tests/test_megatron_engine.py",
    ("value", "megatron"): "one rank per device in a process group: tests/test_megatron_critic.py",
    (
        "rollout",
        "spot",
    ): "composed over another engine with Ray spot instances: tests/test_spot*.py",
}
if importlib.util.find_spec("vllm") is None:
    NOT_BUILT[("rollout", "vllm")] = "needs vLLM's CPU build (the vllm extra)"

BUILTINS = [(k, n) for k in registry.PROTOCOLS for n in registry.names(k)]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET)


@pytest.fixture(scope="module")
def batch(tok) -> dict:
    """Two prompts x 2 responses of a tiny policy, with what the losses read."""
    model = build_model(ModelConfig(**TINY), tok, seed=0).eval()
    out = generate(model, tok, [tok(p).input_ids for p in PROMPTS], n_samples=2,
                   max_new_tokens=4, seed=3)  # fmt: skip
    keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
    b = {k: out[k] for k in keys}
    mask = b["response_mask"].float()
    n = len(mask)
    b |= {"old_logprobs": out["logprobs"], "advantages": torch.tensor([1.0, -1.0] * (n // 2)),
          "old_values": torch.zeros(n, mask.shape[1] + b["prompt_ids"].shape[1]),
          "returns": mask.clone()}  # fmt: skip
    b["old_values"] = response_values(b["old_values"], b)  # [B, R], as the critic hands it
    return b


def model_dict() -> dict:
    return {**TINY, "tokenizer": {"name": "char", "alphabet": ALPHABET}}


def changed(before: dict, after: dict) -> bool:
    return any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(("kind", "name"), BUILTINS)
def test_every_builtin_backend_conforms(kind, name):
    """Registered classes have every protocol method and class attribute; the rollout's
    capability flags match the methods they require."""
    cls = registry.engine_class(kind, name)
    assert registry.missing_members(kind, cls) == []
    assert callable(cls.check)
    if kind == "rollout":
        assert cls.generates or cls.block_steps, f"{name} neither generates nor steps"


def test_check_names_the_setting(tmp_path):
    """``check(config, world_size, role)`` refuses what the backend cannot run."""
    torch_train = registry.engine_class("train", "torch")
    torch_train.check({"tensor_parallel": 1}, None, "actor")  # not placed yet: fine
    with pytest.raises(ValueError, match="actor.pipeline_parallel needs actor.engine=megatron"):
        torch_train.check({"pipeline_parallel": 2}, None, "actor")
    with pytest.raises(ValueError, match="launch it with data_parallel=True"):
        torch_train.check({}, 2, "actor")
    with pytest.raises(ValueError, match="critic.tensor_parallel needs critic.engine=megatron"):
        registry.check_engine("value", "torch", {"tensor_parallel": 2}, 1, "critic")
    vllm = registry.engine_class("rollout", "vllm")
    with pytest.raises(ValueError, match="head dimension >= 64"):
        vllm.check({"model": {"hidden_size": 32, "num_attention_heads": 2}}, None, "rollout")


# -- built and called ----------------------------------------------------------------------


def test_torch_train_engine_methods(tok, batch, tmp_path):
    if ("train", "torch") in NOT_BUILT:
        pytest.skip(NOT_BUILT[("train", "torch")])
    cls = registry.engine_class("train", "torch")
    optim = {"lr": 1e-2, "temperature": 1.0, "kl_coef": 0.1}
    engine = cls(model_dict(), tok, device=CPU, optim=optim, seed=0)
    assert isinstance(engine, registry.protocol("train"))
    assert engine.read_step(iter([[1], [2, 3]])) == [1, 2, 3]
    ref = engine.infer(batch, reference=True)
    before = engine.get_weights()
    loss = make_loss("grpo", "policy", clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.1)
    recs = engine.forward_backward({**batch, "ref_logprobs": ref}, loss, micro_batch_size=2,
                                   normalizer=len(batch["response_ids"]))  # fmt: skip
    assert len(recs) == 2 and all({"loss", "weight"} <= set(r) for r in recs)
    assert engine.reduce_metrics({"x": 1.0}, ("x",)) == {"x": 1.0}
    step = engine.optimizer_step()
    assert step["skipped"] == 0 and step["grad_norm"] > 0 and engine.steps == 1
    assert changed(before, engine.get_weights())
    engine.zero_grad()
    engine.set_lr(1e-3)
    engine.reset_optimizer()
    with engine.solo() as solo:
        assert solo.model is engine.model
    engine.publish()  # refreezes the reference: now the trained weights'
    assert not torch.equal(engine.infer(batch, reference=True), ref)
    engine.load_weights(before)
    assert not changed(before, engine.get_weights())
    state = engine.save(tmp_path / "actor")
    assert state["trainer_steps"] == 1 and (tmp_path / "actor" / "model.safetensors").exists()
    engine.load(tmp_path / "actor", state)
    engine.offload()
    engine.onload()
    assert engine.infer(batch).shape == batch["response_ids"].shape


def test_torch_value_engine_methods(tok, batch):
    cls = registry.engine_class("value", "torch")
    engine = cls(model_dict(), tok, device=CPU, optim={"lr": 1e-2}, seed=0)
    assert isinstance(engine, registry.protocol("value"))
    policy = build_model(ModelConfig(**TINY), tok, seed=1)
    engine.load_backbone(policy.state_dict())
    values = engine.infer(batch, response_values, micro_batch_size=2)
    assert values.shape == batch["response_ids"].shape
    snap, state = engine.snapshot(), engine.state_dict()
    loss = make_loss("value", "value", value_clip=0.2)
    engine.forward_backward(batch, loss, normalizer=len(values))
    assert engine.optimizer_step()["skipped"] == 0
    assert engine.update_norm(snap) > 0
    assert engine.reduce_metrics({"x": 2.0}, ("x",)) == {"x": 2.0}
    engine.zero_grad()
    engine.reset_optimizer()
    model, opt = copy.deepcopy(engine.checkpoint_state())  # live tensors: copied
    engine.load_state_dict(state)
    assert not changed(state, engine.state_dict())
    engine.load_checkpoint_state(model, opt)
    assert changed(state, engine.state_dict())
    engine.offload()
    engine.onload()


def test_torch_logprob_engine_methods(tok, batch):
    cls = registry.engine_class("logprob", "torch")
    engine = cls(model_dict(), tok, device=CPU, temperature=1.0, micro_batch_size=2)
    weights = build_model(ModelConfig(**TINY), tok, seed=1).state_dict()
    engine.load_state_dict(weights)
    assert not changed(weights, engine.state_dict())
    engine.offload()
    engine.onload()
    chunk = TensorDict(batch, batch_size=[len(batch["response_ids"])])  # a rollout chunk's
    assert engine.logprobs(chunk).shape == batch["response_ids"].shape


def test_torch_actor_critic_engine_methods():
    from m2flow.workers.algos.actor_critic import actor_critic_loss
    from m2flow.workers.embodied.policy import ActorCritic

    torch.manual_seed(0)
    cls = registry.engine_class("actor_critic", "torch")
    engine = cls(ActorCritic(4, 2, 8), device=CPU, lr=1e-2, grad_clip=0.5)
    n = 16
    mb = {"obs": torch.randn(n, 4), "actions": torch.randint(0, 2, (n,)),
          "logprobs": torch.full((n,), -0.69), "values": torch.zeros(n),
          "advantages": torch.randn(n), "returns": torch.ones(n)}  # fmt: skip
    before, snap = engine.get_weights(), engine.snapshot()
    saved = copy.deepcopy(engine.checkpoint_state())

    def loss(model, b):
        return actor_critic_loss(model, b, clip_eps=0.2, value_clip=0.2, vf_coef=0.5, ent_coef=0.01)

    out = engine.forward_backward(mb, loss)
    assert {"loss", "pg_loss", "vf_loss", "entropy", "approx_kl", "clip_frac"} <= set(out)
    assert engine.optimizer_step()["grad_norm"] > 0
    assert engine.update_norm(snap) > 0 and changed(before, engine.get_weights())
    engine.load_checkpoint_state(*saved)
    assert not changed(before, engine.get_weights())
    engine.offload()
    engine.onload()
    with pytest.raises(ValueError, match="algorithm.engine=torch trains the actor-critic on one"):
        cls.check({}, 2, "algorithm")


ROLLOUT_BUILT = [n for n in registry.names("rollout") if ("rollout", n) not in NOT_BUILT]


@pytest.mark.parametrize("name", ROLLOUT_BUILT)
def test_rollout_engine_methods(name, tok):
    """Built by ``build``; pauses, takes weights, resumes; steps or generates with them (every
    token labelled with the new version); sleeps and wakes."""
    cls = registry.engine_class("rollout", name)
    args = {"temperature": 1.0, "top_p": 1.0, "seed": 7, "batch_rows": 4, "model": model_dict(),
            "emulated": {}, "eos_id": tok.eos_token_id, "filler_id": 7}  # fmt: skip
    m = build_model(ModelConfig(**TINY), tok, seed=0).eval() if cls.needs_model else None
    engine = cls.build(args, m, tok)
    # (no isinstance: the protocol's generate and step are each required only with their flag)
    assert hasattr(engine, "model") and registry.missing_members("rollout", type(engine)) == []
    assert engine.version == -1
    new = build_model(ModelConfig(**TINY), tok, seed=1).state_dict() if m is not None else {}
    engine.pause()
    engine.update_weights(3, copy.deepcopy(new))
    engine.resume()
    assert engine.version == 3
    if m is not None and engine.model is m:
        assert torch.equal(m.state_dict()["lm_head.weight"], new["lm_head.weight"])
    if cls.block_steps:
        reqs = [GenRequest(f"0:{i}", tok(p).input_ids, (0, i, 0), 8) for i, p in enumerate(PROMPTS)]
        assert engine.step(reqs, 2) == 4 and all(r.versions == [3, 3] for r in reqs)
    if cls.generates:
        out = engine.generate([tok(PROMPTS[0]).input_ids], 2, 3, [(0, 0)])
        assert out["versions"][out["response_mask"].bool()].eq(3).all()
    assert isinstance(engine.sleep(), bool) and isinstance(engine.wake_up(), bool)


@pytest.mark.parametrize(("kind", "name"), sorted(NOT_BUILT))
def test_not_built_here(kind, name):
    pytest.skip(f"{kind} engine {name!r} not built on CPU: {NOT_BUILT[(kind, name)]}")


# -- refused -------------------------------------------------------------------------------


def test_a_class_missing_methods_is_refused():
    class HalfEngine:
        one_rank_per_device = whole_step = False

        @classmethod
        def check(cls, config, world_size=None, role="critic"):
            pass

        def forward_backward(self, batch, loss, micro_batch_size=None, normalizer=None):
            return []

    msg = r"HalfEngine is not a value engine: it lacks optimizer_step, zero_grad, .*onload"
    with pytest.raises(registry.EngineProtocolError, match=msg):
        registry.register("value", "half", HalfEngine)
    assert "half" not in registry.names("value")
    with pytest.raises(registry.EngineProtocolError, match="it lacks pause, resume"):
        registry.engine_class("rollout", "tiny_rollout_engine:NoPause")
    with pytest.raises(ValueError, match="rollout.engine must be hf or vllm"):
        registry.engine_class("rollout", "sglang", "rollout")


# -- an engine by import path, through the runner ------------------------------------------


def test_import_path_rollout_engine_is_accepted_by_the_runner(tmp_path, tok):
    """``rollout.engine=module:Class``: the GRPO workflow's validation asks the class (its
    ``check``, which refuses a setting of its own); a class missing protocol methods is a
    config error naming them; the role's builder builds it and it samples."""
    path = "tiny_rollout_engine:WrappedHfEngine"
    over = [f"rollout.engine={path}", f"trainer.run_dir={tmp_path}"]
    prepare(str(GRPO), over)  # validated: no error
    with pytest.raises(ConfigError, match="rollout.n_samples=65: this engine takes <= 64"):
        prepare(str(GRPO), [*over, "rollout.n_samples=65"])
    with pytest.raises(ConfigError, match="NoPause is not a rollout engine: it lacks pause"):
        prepare(str(GRPO), ["rollout.engine=tiny_rollout_engine:NoPause", over[1]])
    with pytest.raises(ConfigError, match="rollout.engine=.*exact.* continues blocks"):
        prepare(str(GRPO), ["rollout.engine=exact", over[1]])
    m = build_model(ModelConfig(**TINY), tok, seed=0).eval()
    args = {"temperature": 1.0, "top_p": 1.0, "seed": 7, "model": model_dict()}
    engine = build_rollout_engine(path, args, m, tok)
    out = engine.generate([tok(PROMPTS[0]).input_ids], 2, 3, [(0, 0)])
    assert engine.calls == 1 and out["response_ids"].shape[0] == 2
