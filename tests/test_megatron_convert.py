"""The Megatron engine on Hugging Face checkpoints a user brings: Qwen2, Llama and Mistral in,
Hugging Face checkpoints of the same class out, everything else refused by name.

CPU, fp32, gloo; skipped without the ``megatron`` extra. Each model is a tiny random one built
from its transformers config (``AutoModelForCausalLM.from_config``), its norms and biases
perturbed away from HF's 1/0 initialisation (a mislaid norm or bias then shows),
``save_pretrained`` to a tmp dir and loaded back with ``AutoModelForCausalLM.from_pretrained``:

- ``qwen2``: q/k/v biases, GQA (4 heads, 2 KV), tied embeddings, ``rope_theta=1e6``;
- ``llama``: Llama 3.1 style: GQA, ``head_dim=32`` set explicitly (not hidden/heads = 16),
  untied, ``rope_type="llama3"`` scaling (``rope_theta=5e5``, factor 8, original 32 positions);
- ``llama-tied``: Llama 2 style multi-head (4 KV heads), tied, ``rope_type="linear"`` (factor 2);
- ``mistral``: no sliding window, ``head_dim=8`` set explicitly, untied.

Checks (tolerances as tests/test_megatron.py; measured values in docs/results/megatron.md):

- HF -> Megatron TP shards (tp = 1, 2; tp = 2 x pp = 2 stages) -> HF: every weight
  ``torch.equal``, exactly the original's keys, loads with ``strict=True`` into the original
  class, and through ``save_pretrained`` / ``from_pretrained``;
- per-token logprobs of the Megatron forward (TP=1, in this process) vs the HF forward:
  ``atol=1e-5``; the Llama at PP=2 (spawned, Megatron's pipeline schedule): logprobs, loss,
  gradients and one AdamW step as tests/test_megatron.py's parity cases;
- the actor's engine (``MegatronEngine``, TP=2, KL to its reference shard) on the Llama: two
  GRPO updates vs the torch engine's; its ``gather_hf`` loads strictly into
  ``LlamaForCausalLM``;
- the critic's engine (``MegatronCritic``, TP=2) on a Llama trunk vs the torch critic: values,
  value loss, weights and AdamW moments after 4 steps; conversion round trip bit-exact;
- refusals: GPT-2 and Qwen3 checkpoints at launch (``check_config`` from ``model.path``; the
  message names the supported architectures and ``actor.engine=torch`` /
  ``critic.engine=torch``), and the settings of a supported family that do not map.
"""

from __future__ import annotations

import copy
import importlib.util
import socket
import warnings

import pytest

if importlib.util.find_spec("megatron") is None or (
    importlib.util.find_spec("megatron.core") is None
):
    pytest.skip(
        "megatron-core not installed: pip install -c constraints.txt -e '.[megatron]'",
        allow_module_level=True,
    )

import torch  # noqa: E402
from m2flow.workers.algos.logprobs import sequence_logprobs  # noqa: E402
from test_megatron import (  # noqa: E402
    ADAMW,
    ADAMW_TRAINER,
    LOGPROB_ATOL,
    WEIGHT_ATOL,
    _batch,
    _gathered,
    _hf_step,
    _keys,
)
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU/gloo parity tests; the CUDA/NCCL path is not covered"
)
VOCAB = 50
#: weights after 4 AdamW steps at TP=2 (the critic case): test_megatron_critic.py TP_DP_WEIGHT_ATOL
#: says why 1e-5 fails on avx2 kernels; a gradient wrong in direction moves a weight by ~lr = 1e-3
TP_WEIGHT_ATOL = 5e-5
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 5e5,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CONFIGS = {
    "qwen2": lambda: Qwen2Config(
        **SHAPE, intermediate_size=128, num_key_value_heads=2, rope_theta=1e6,
        tie_word_embeddings=True, max_position_embeddings=128,
    ),
    "llama": lambda: LlamaConfig(
        **SHAPE, intermediate_size=96, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
        tie_word_embeddings=False, max_position_embeddings=128, rope_parameters=LLAMA3_ROPE,
    ),
    "llama-tied": lambda: LlamaConfig(
        **SHAPE, intermediate_size=96, num_key_value_heads=4, tie_word_embeddings=True,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
    ),
    "mistral": lambda: MistralConfig(
        **SHAPE, intermediate_size=96, num_key_value_heads=2, head_dim=8, sliding_window=None,
        tie_word_embeddings=False, max_position_embeddings=128,
    ),
}  # fmt: skip
CLASSES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
           "llama-tied": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}  # fmt: skip


def _random_model(config, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``{name: (directory, model loaded back with from_pretrained)}`` for :data:`CONFIGS`,
    plus the GPT-2 and Qwen3 directories the refusals read."""
    out = {}
    for name, make in CONFIGS.items():
        path = tmp_path_factory.mktemp(name)
        _random_model(make()).save_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        assert type(model).__name__ == CLASSES[name]
        out[name] = (path, model)
    others = {
        "gpt2": GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB),
        "qwen3": Qwen3Config(**SHAPE, intermediate_size=96, num_key_value_heads=2),
    }
    for name, config in others.items():
        path = tmp_path_factory.mktemp(name)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        out[name] = (path, None)
    return out


@pytest.fixture(scope="module")
def single_rank_group():
    """A one-process gloo group with Megatron parallel state TP=PP=1 (in this process)."""
    import torch.distributed as dist
    from m2flow.workers.engines.megatron.model import init_parallel
    from megatron.core import parallel_state

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    init_parallel(tp=1, pp=1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _strict_load(model, state: dict) -> None:
    """``state`` into a fresh model of ``model``'s class and config with ``strict=True``;
    every tensor equal afterwards."""
    fresh = type(model)(copy.deepcopy(model.config))
    fresh.load_state_dict(state, strict=True)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


# -- conversion --------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trip_bit_exact_and_loads_strictly(saved, name, tp):
    from m2flow.workers.engines.megatron.convert import hf_keys, hf_to_megatron, megatron_to_hf
    from m2flow.workers.engines.megatron.model import megatron_shape

    model = saved[name][1]
    state = model.state_dict()
    shape = megatron_shape(model.config, tp=tp)
    assert shape.architecture == CLASSES[name] and shape.qkv_bias == (name == "qwen2")
    assert hf_keys(shape) == set(state)
    shards = [hf_to_megatron(state, shape, tp_rank=r, tp_size=tp) for r in range(tp)]
    cfg = model.config
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * shape.head_dim
    assert shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"].shape[0] * tp == qkv
    has_bias = "decoder.layers.0.self_attention.linear_qkv.bias" in shards[0]
    assert has_bias == (name == "qwen2")
    back = megatron_to_hf(shards, shape)
    assert set(back) == set(state)
    for k, v in state.items():
        assert torch.equal(back[k], v), k
    _strict_load(model, back)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trip_pipeline_stages(saved, name):
    """tp=2 x pp=2: each stage its own layers renumbered from 0, merged back bit-exact."""
    from m2flow.workers.engines.megatron.convert import (
        hf_to_megatron,
        megatron_to_hf,
        merge_pipeline_stages,
    )
    from m2flow.workers.engines.megatron.model import megatron_shape

    model = saved[name][1]
    state = model.state_dict()
    shape = megatron_shape(model.config, tp=2)
    shards = []
    for r in range(2):
        first = hf_to_megatron(state, shape, r, 2, layer_offset=0, num_layers=1, post_process=False)
        last = hf_to_megatron(state, shape, r, 2, layer_offset=1, num_layers=1, pre_process=False)
        assert ("output_layer.weight" in last) and "embedding.word_embeddings.weight" not in last
        shards.append(merge_pipeline_stages([first, last], [1, 1]))
    back = megatron_to_hf(shards, shape)
    assert set(back) == set(state)
    assert all(torch.equal(back[k], v) for k, v in state.items())


@pytest.mark.parametrize("name", ["llama", "llama-tied", "mistral"])
def test_back_converted_checkpoint_loads_with_from_pretrained(saved, name, tmp_path):
    """What the actor saves: its HF copy loaded with the gathered weights, ``save_pretrained``;
    ``AutoModelForCausalLM.from_pretrained`` gives the same class and the same weights."""
    from m2flow.workers.engines.megatron.convert import hf_to_megatron, megatron_to_hf
    from m2flow.workers.engines.megatron.model import megatron_shape

    model = saved[name][1]
    shape = megatron_shape(model.config, tp=2)
    back = megatron_to_hf(
        [hf_to_megatron(model.state_dict(), shape, r, 2) for r in range(2)], shape
    )
    copy_ = type(model)(copy.deepcopy(model.config))
    copy_.load_state_dict(back, strict=True)
    copy_.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(again) is type(model)
    assert again.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(again.state_dict()[k], v) for k, v in model.state_dict().items())


def test_weights_a_family_does_not_have_are_refused(saved):
    """A Qwen2 state dict (q/k/v biases) given to a Llama-shaped conversion: nothing dropped
    silently."""
    import dataclasses

    from m2flow.workers.engines.megatron.convert import hf_to_megatron
    from m2flow.workers.engines.megatron.model import megatron_shape

    qwen = saved["qwen2"][1]
    shape = dataclasses.replace(megatron_shape(qwen.config), qkv_bias=False)
    with pytest.raises(KeyError, match=r"no place for.*self_attn\.k_proj\.bias"):
        hf_to_megatron(qwen.state_dict(), shape)


# -- forward parity ----------------------------------------------------------------------------


@cpu_only
@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp1_logprobs_match_hf(single_rank_group, saved, name):
    """Megatron's forward vs the HF model's, per-token logprobs (left-padded prompts,
    right-padded responses); the live Megatron model's state converts back exactly."""
    from m2flow.workers.engines.megatron.convert import (
        hf_to_megatron,
        load_megatron_state,
        megatron_state,
        megatron_to_hf,
    )
    from m2flow.workers.engines.megatron.model import build_gpt_model, megatron_sequence_logprobs

    hf = saved[name][1]
    mg = build_gpt_model(hf.config).eval()
    load_megatron_state(mg, hf_to_megatron(hf.state_dict(), mg.m2flow_shape))
    back = megatron_to_hf([megatron_state(mg)], mg.m2flow_shape)
    assert back.keys() == hf.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
    batch = _batch(VOCAB, r=40)  # 45 positions: past the llama3 rope's original 32
    with torch.no_grad():
        want = sequence_logprobs(hf, *_keys(batch))
        got = megatron_sequence_logprobs(mg, *_keys(batch))
    diff = float((got - want).abs().max())
    print(f"{name} TP1 logprobs vs HF: {diff:.2g}")
    torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=0)
    if name.startswith("llama"):  # the scaled RoPE matters: unscaled logprobs differ
        cfg = copy.deepcopy(hf.config)
        cfg.rope_parameters = {
            "rope_type": "default",
            "rope_theta": cfg.rope_parameters["rope_theta"],
        }
        plain = type(hf)(cfg).eval()
        plain.load_state_dict(hf.state_dict())
        with torch.no_grad():
            unscaled = sequence_logprobs(plain, *_keys(batch))
        off = float((unscaled - want).abs().max())
        print(f"{name}: logprobs with the unscaled RoPE differ by {off:.2g}")
        assert off > 100 * LOGPROB_ATOL


@cpu_only
@pytest.mark.timeout(240)
def test_llama_pp2_step_matches_hf(saved, tmp_path):
    """The Llama (untied, llama3 RoPE, head_dim 32) at TP=1 x PP=2 over gloo (Megatron's 1F1B
    schedule): logprobs, loss, gradients and weights after one AdamW step vs the HF model
    (tests/test_megatron.py's parity harness)."""
    from m2flow.workers.engines.megatron.model import megatron_shape
    from m2flow.workers.engines.megatron.parity import spawn_parity

    hf = copy.deepcopy(saved["llama"][1]).train()
    batch = _batch(VOCAB)
    with torch.no_grad():  # behaviour policy slightly off the current one: ratios != 1
        old = sequence_logprobs(hf, *_keys(batch))
        g = torch.Generator().manual_seed(7)
        noise = 0.05 * torch.randn(old.shape, generator=g)
        batch["old_logprobs"] = (old + noise) * batch["response_mask"]
    torch.save(
        {"hf_config": hf.config, "hf_state": hf.state_dict(), "batch": batch, "adamw": ADAMW},
        tmp_path / "case.pt",
    )
    spawn_parity(tmp_path, tp=1, pp=2, timeout_s=200)
    want_lp, want_loss, want_grads, want_state = _hf_step(hf, batch)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    (last,) = [r for r in ranks if "loss" in r]
    shape = megatron_shape(hf.config)
    grads = _gathered(ranks, "grads", 0, 1, shape)
    state = _gathered(ranks, "state", 0, 1, shape)
    diffs = {
        "logprobs": float((last["logprobs"] - want_lp).abs().max()),
        "loss": abs(float(last["loss"] - want_loss)),
        "grads": max(float((grads[k] - v).abs().max()) for k, v in want_grads.items()),
        "weights": max(float((state[k] - v).abs().max()) for k, v in want_state.items()),
    }
    print("llama PP2 vs HF:", {k: f"{v:.2g}" for k, v in diffs.items()})
    assert diffs["logprobs"] <= LOGPROB_ATOL and diffs["loss"] <= LOGPROB_ATOL
    for k, v in want_grads.items():
        torch.testing.assert_close(grads[k], v, atol=1e-6, rtol=1e-4, msg=k)
    assert diffs["weights"] <= WEIGHT_ATOL


@cpu_only
@pytest.mark.timeout(240)
def test_llama_engine_tp2_grpo_matches_torch_engine(saved, tmp_path):
    """``MegatronEngine`` at TP=2 on the Llama, ``kl_coef`` 0.1 against its reference shard:
    two ``train`` calls (mini-batches of 6 in micro-batches of 4, then the whole batch of 10)
    vs the torch engine's GRPO update (reference logprobs from a frozen copy): metrics and
    weights; the engine's ``gather_hf`` loads strictly into ``LlamaForCausalLM``."""
    from m2flow.workers.engines.megatron.parity import engine_rank, spawn_parity
    from m2flow.workers.engines.torch_engine import TorchEngine
    from test_llm import loss_args, train_on_batch

    hf = copy.deepcopy(saved["llama"][1])
    reference = copy.deepcopy(hf).eval()  # only infer: its AdamW never steps
    batch = _batch(VOCAB, b=10)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the policy off its reference, so the KL term is not 0
        for p in hf.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    trainer = dict(ADAMW_TRAINER, kl_coef=0.1)
    steps = [(6, 4), (None, 4)]
    torch.save(
        {
            "hf_config": hf.config,
            "hf_state": reference.state_dict(),
            "policy_state": hf.state_dict(),
            "batch": batch,
            "trainer": dict(trainer, shared_prefix=False),
            "steps": steps,
        },
        tmp_path / "case.pt",
    )
    spawn_parity(tmp_path, tp=2, timeout_s=200, target=engine_rank)
    got = torch.load(tmp_path / "engine.pt", weights_only=False)

    torch_engine = TorchEngine.from_module(hf, **dict(trainer, kl_coef=0.0), shared_prefix=False)
    frozen = TorchEngine.from_module(reference, **dict(trainer, kl_coef=0.0), shared_prefix=False)
    diffs = {}
    for (mini, micro), metrics in zip(steps, got["metrics"]):
        ref = frozen.infer(batch, None, micro)
        want = train_on_batch(torch_engine, dict(batch, ref_logprobs=ref), mini, micro,
                              **loss_args(trainer))  # fmt: skip
        assert metrics["steps"] == want["steps"] and want["kl"] > 1e-3
        for k in ("loss", "pg_loss", "kl", "grad_norm"):
            diffs[k] = max(diffs.get(k, 0.0), abs(metrics[k] - want[k]))
    want_state = hf.state_dict()
    diffs["weights"] = max(float((got["hf"][k] - v).abs().max()) for k, v in want_state.items())
    print("llama engine TP2 KL vs torch engine:", {k: f"{v:.2g}" for k, v in diffs.items()})
    assert all(diffs[k] <= LOGPROB_ATOL for k in ("loss", "pg_loss", "kl", "grad_norm")), diffs
    assert diffs["weights"] <= 3 * WEIGHT_ATOL, diffs  # three AdamW steps (test_megatron.py)
    assert not any(k.endswith("bias") for k in got["hf"])
    type(hf)(copy.deepcopy(hf.config)).load_state_dict(got["hf"], strict=True)


# -- the critic on a Llama trunk ---------------------------------------------------------------


def _llama_critic(saved, seed: int = 0):
    """A torch critic (``ValueModel``'s forward and head) on the Llama's trunk, its head
    perturbed away from 0 (a mislaid head then shows)."""
    from m2flow.workers.engines.value_model import ValueModel

    class LlamaCritic(ValueModel):
        def __init__(self, lm):
            torch.nn.Module.__init__(self)
            self.backbone = copy.deepcopy(lm.model)
            self.head = torch.nn.Linear(lm.config.hidden_size, 1)

    critic = LlamaCritic(saved["llama"][1])
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for p in critic.head.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return critic


@pytest.mark.parametrize("tp", [1, 2])
def test_critic_round_trip_llama_trunk(saved, tp):
    from m2flow.workers.engines.megatron.critic import critic_to_megatron, megatron_to_critic
    from m2flow.workers.engines.megatron.model import megatron_shape

    critic = _llama_critic(saved)
    state = critic.state_dict()
    shape = megatron_shape(critic.backbone.config, tp)
    shards = [critic_to_megatron(state, shape, r, tp) for r in range(tp)]
    back = megatron_to_critic(shards, shape)
    assert back.keys() == state.keys() and not any("bias" in k for k in back if "head" not in k)
    assert all(torch.equal(back[k], state[k]) for k in state)


@cpu_only
@pytest.mark.timeout(300)
def test_critic_tp2_llama_matches_torch_critic(saved, tmp_path):
    """``MegatronCritic`` at TP=2 on the Llama trunk (spawned ranks; the critic's parity
    harness) vs the torch critic: values, value-loss metrics, weights and AdamW moments after 2
    epochs of 2 mini-batches (4 AdamW steps), then 4 more steps resumed from the torch
    critic's checkpoint."""
    from m2flow.workers.algos.losses import make_loss, response_values
    from m2flow.workers.engines.megatron.critic_parity import critic_parity_rank
    from m2flow.workers.engines.megatron.parity import spawn_parity
    from m2flow.workers.engines.torch_engine import TorchValueEngine
    from m2flow.workers.engines.update import value_update

    optim = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01, grad_clip=1.0)
    train = dict(value_clip=0.2, mini=2, micro=1, epochs=2, seed=3)
    critic = _llama_critic(saved)
    initial = {k: v.clone() for k, v in critic.state_dict().items()}
    batch = _batch(VOCAB)
    g = torch.Generator().manual_seed(1)
    batch["returns"] = 0.5 * torch.randn(batch["response_mask"].shape, generator=g)
    batch["old_values"] = 0.5 * torch.randn(batch["response_mask"].shape, generator=g)
    for k in ("returns", "old_values"):
        batch[k] = batch[k] * batch["response_mask"]
    trainer = TorchValueEngine.from_module(critic, **optim)
    loss = make_loss("value", "value", value_clip=train["value_clip"])

    def update():
        gen = torch.Generator().manual_seed(train["seed"])
        t = train
        return value_update(trainer, batch, loss, t["mini"], t["micro"], t["epochs"], gen)

    want_values = trainer.infer(batch, response_values, train["micro"])
    metrics_a = update()
    state_a = {k: v.clone() for k, v in critic.state_dict().items()}
    opt = trainer.optimizer.state_dict()
    optimizer_a = {
        "state": {i: {k: v.clone() for k, v in s.items()} for i, s in opt["state"].items()},
        "param_groups": opt["param_groups"],
    }
    metrics_b = update()
    torch.save(
        {
            "hf_config": critic.backbone.config,
            "initial": initial,
            "names": [n for n, _ in critic.named_parameters()],
            "batch": batch,
            "optim": optim,
            "train": train,
            "state_a": state_a,
            "optimizer_a": optimizer_a,
        },
        tmp_path / "case.pt",
    )
    spawn_parity(tmp_path, tp=2, dp=1, timeout_s=280, target=critic_parity_rank)
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)

    def worst(a: dict, b: dict) -> float:
        assert a.keys() == b.keys()
        return max(float((a[k] - b[k]).abs().max()) for k in b)

    diffs = {
        "values": float((got["values"] - want_values).abs().max()),
        "vf_loss": max(abs(got[m]["vf_loss"] - w["vf_loss"])
                       for m, w in (("metrics_a", metrics_a), ("metrics_b", metrics_b))),
        "weights_a": worst(got["state_a"], state_a),
        "weights_b": worst(got["state_b"], critic.state_dict()),
        "grad_norm": abs(got["metrics_a"]["grad_norm"] - metrics_a["grad_norm"]),
        "moments": max(worst(got["optimizer_a"]["state"][i], st)
                       for i, st in optimizer_a["state"].items()),
    }  # fmt: skip
    print("critic TP2 llama vs torch critic:", {k: f"{v:.2g}" for k, v in diffs.items()})
    assert float(want_values.abs().max()) > 0.01 and got["metrics_a"]["steps"] == 4
    for key in ("vf_loss", "vf_clip_frac", "value_mean", "grad_norm"):
        # relative for the pre-clip gradient norm (~63 here: fp32 rounding scales with it)
        scale = max(1.0, abs(metrics_a[key]))
        assert abs(got["metrics_a"][key] - metrics_a[key]) <= LOGPROB_ATOL * scale, key
    assert diffs["values"] <= LOGPROB_ATOL and diffs["vf_loss"] <= LOGPROB_ATOL
    # 4 AdamW steps on TP-split matmuls: the tiny-gradient coordinates Adam amplifies differ by
    # 2.1e-5 with avx2 kernels (CI's CPU), as in test_megatron_critic.py's TP_DP_WEIGHT_ATOL
    assert max(diffs["weights_a"], diffs["weights_b"], diffs["moments"]) <= TP_WEIGHT_ATOL, diffs


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "role", "match"),
    [
        ("gpt2", "actor", r"model GPT2LMHeadModel \(model_type='gpt2'\).*actor\.engine=torch"),
        ("qwen3", "actor", r"Qwen3ForCausalLM.*q_norm.*actor\.engine=torch"),
        ("qwen3", "critic", r"Qwen3ForCausalLM.*critic\.engine=torch"),
    ],
)
def test_unsupported_checkpoint_is_refused_at_launch(saved, name, role, match):
    """``check_config`` (what ``ActorWorker.launch`` / ``CriticWorker.launch`` run before any
    process starts) on ``model.path``: one line naming the model, the supported architectures
    and the torch engine. The workers' own launch checks refuse it the same way."""
    from m2flow.workers.actor.worker import ActorWorker
    from m2flow.workers.critic.config import CriticOptions
    from m2flow.workers.critic.worker import CriticWorker
    from m2flow.workers.engines.megatron.arch import UnsupportedModel
    from m2flow.workers.engines.megatron.engine import check_config

    model = {"path": str(saved[name][0])}
    with pytest.raises(UnsupportedModel, match=match) as info:
        check_config(2, {"model": model, "tensor_parallel": 2}, role=role)
    message = str(info.value)
    assert "\n" not in message
    assert all(c in message for c in set(CLASSES.values()))
    print(message)
    with pytest.raises(UnsupportedModel, match=match):
        if role == "actor":
            ActorWorker._check(1, {"engine": "megatron", "model": model})
        else:
            CriticWorker._check(1, CriticOptions(engine="megatron"), model)


def test_supported_checkpoints_pass_the_launch_checks(saved):
    """Every supported checkpoint passes ``check_config`` from ``model.path`` at TP=2; the
    divisibility checks read the checkpoint's config (here: its MLP width); a path without a
    config is named."""
    from m2flow.workers.engines.megatron.engine import check_config

    for name in CONFIGS:
        check_config(4, {"model": {"path": str(saved[name][0])}, "tensor_parallel": 2})
    odd = LlamaConfig(**SHAPE, intermediate_size=97, num_key_value_heads=2)
    with pytest.raises(ValueError, match="model.intermediate_size=97 is not divisible by actor"):
        check_config(2, {"model": odd, "tensor_parallel": 2})
    with pytest.raises(ValueError, match="no config.json"):
        check_config(1, {"model": {"path": str(saved["llama"][0] / "missing")}})


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (lambda: Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=1,
                             num_hidden_layers=2, max_position_embeddings=128),
         "sliding_window=16 < max_position_embeddings=128"),
        (lambda: MistralConfig(sliding_window=16, max_position_embeddings=128),
         "model MistralForCausalLM.*sliding-window"),
        (lambda: LlamaConfig(attention_bias=True), "attention_bias=true"),
        (lambda: LlamaConfig(mlp_bias=True), "mlp_bias=true"),
        (lambda: LlamaConfig(hidden_act="gelu"), "hidden_act='gelu'"),
        (lambda: LlamaConfig(attention_dropout=0.1), "attention_dropout=0.1"),
        (lambda: LlamaConfig(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                              "factor": 4.0}), "rope_type='yarn'"),
        (lambda: LlamaConfig(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                              "factor": 4.0}), "rope_type='dynamic'"),
        (lambda: GPT2Config(), "model_type='gpt2'"),
    ],
    ids=["qwen2-window", "mistral-window", "llama-attn-bias", "llama-mlp-bias", "gelu",
         "dropout", "yarn", "dynamic", "gpt2"],
)  # fmt: skip
def test_settings_without_exact_mapping_are_refused(config, match):
    """A supported family with a setting the conversion cannot map: refused before any model
    is built (``megatron_shape``, which ``build_gpt_model`` and the conversion call)."""
    from m2flow.workers.engines.megatron.arch import UnsupportedModel, architecture
    from m2flow.workers.engines.megatron.model import megatron_shape

    cfg = config()
    with pytest.raises(UnsupportedModel, match=match):
        architecture(cfg)
    with pytest.raises(UnsupportedModel, match="set actor.engine=torch to train"):
        megatron_shape(cfg)


def test_windows_that_never_cut_are_accepted():
    """A sliding window at least as long as the model's positions changes nothing: mapped
    (Qwen2.5 configs carry ``sliding_window`` with ``use_sliding_window=false``)."""
    from m2flow.workers.engines.megatron.arch import architecture

    assert architecture(MistralConfig(sliding_window=4096, max_position_embeddings=4096))
    assert architecture(Qwen2Config(use_sliding_window=False, sliding_window=16))
    arch = architecture(LlamaConfig(rope_parameters=LLAMA3_ROPE, max_position_embeddings=128))
    assert arch.rope_type == "llama3" and not arch.qkv_bias
