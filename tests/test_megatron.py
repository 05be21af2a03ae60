"""Megatron-core actor backend: checkpoint conversion and parity with the torch (HF) engine.

CPU, fp32, gloo. Skipped as a whole without the ``megatron`` extra (``megatron-core==0.16.1``).
Tolerances (measured on this 2-core CPU box, see docs/results/megatron.md):

- conversion HF -> Megatron -> HF: bit-exact (``torch.equal``), tp = 1, 2, 4 shards;
- per-token logprobs and loss, Megatron (TP=1 in-process; TP=2, PP=2, TP=2 x DP=2 over gloo) vs the
  HF model on one rank: ``atol=1e-5`` (observed: logprobs 2.4e-7, loss 7e-8);
- gradients: ``atol=1e-6, rtol=1e-4`` (observed 1.8e-7 absolute, largest gradient 0.64);
- weights after one AdamW step (``lr=1e-3``): ``atol=1e-5``, i.e. 1% of a step (observed 7.8e-7:
  Adam's first step is ``lr * g / (|g| + eps)``, so rounding in tiny gradients is amplified);
- the actor's engine (``MegatronEngine``, TP=1 x PP=2, KL to its reference shard, padded
  micro-batches) vs the torch engine: metrics ``1e-5``, weights after three AdamW steps
  (``lr=1e-3``, torch's ``eps=1e-8``) ``3e-5``.
"""

from __future__ import annotations

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
from m2flow.workers.algos.grpo import grpo_loss  # noqa: E402
from m2flow.workers.algos.logprobs import sequence_logprobs  # noqa: E402
from m2flow.workers.llm import ModelConfig, build_char_tokenizer, build_model  # noqa: E402

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

# The model tests feed CPU tensors to a CPU-initialised model over gloo (the CPU shims); on a
# CUDA host Megatron builds on the GPU instead, a path these tests do not cover.
cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU/gloo parity tests; the CUDA/NCCL path is not covered"
)

ADAMW = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)
#: the same AdamW as the torch engine's arguments (its eps is torch's default, 1e-8)
ADAMW_TRAINER = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01, grad_clip=1.0)
LOGPROB_ATOL = 1e-5
WEIGHT_ATOL = 1e-5


def _hf_model(tie: bool = True, seed: int = 0):
    tok = build_char_tokenizer()
    cfg = ModelConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1e6,
        tie_word_embeddings=tie,
    )
    model = build_model(cfg, tok, seed=seed)
    # HF initialises biases to 0 and norms to 1: perturb them so a mislaid bias or norm shows.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def _batch(vocab: int, seed: int = 1, b: int = 4, p: int = 5, r: int = 6):
    """Left-padded prompts, right-padded responses, old logprobs/advantages for the GRPO loss."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(4, vocab, (b, p), generator=g)
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    prompt_mask[0, :2] = 0
    prompt_mask[1, :1] = 0
    response_ids = torch.randint(4, vocab, (b, r), generator=g)
    response_mask = torch.ones(b, r, dtype=torch.long)
    response_mask[2, 4:] = 0
    response_mask[3, 2:] = 0
    prompt_ids[prompt_mask == 0] = 0
    response_ids[response_mask == 0] = 0
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": response_ids,
        "response_mask": response_mask,
        "advantages": torch.randn(b, generator=g),
    }


def _keys(batch):
    return [batch[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]


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


# -- (a) conversion ---------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_conversion_round_trip_bit_exact(tie, tp):
    from m2flow.workers.engines.megatron.convert import hf_to_megatron, megatron_to_hf
    from m2flow.workers.engines.megatron.model import megatron_shape

    hf = _hf_model(tie=tie)
    state = hf.state_dict()
    shape = megatron_shape(hf.config, tp=tp)
    shards = [hf_to_megatron(state, shape, tp_rank=r, tp_size=tp) for r in range(tp)]
    # Shards split the parallel dimensions: a rank holds 1/tp of the QKV rows and vocab rows.
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert shards[0][qkv].shape[0] * tp == (4 + 2 * 2) * 16
    assert shards[0]["embedding.word_embeddings.weight"].shape[0] * tp == shape.padded_vocab_size
    back = megatron_to_hf(shards, shape)
    assert set(back) == set(state)
    for k, v in state.items():
        assert torch.equal(back[k], v), k


@pytest.mark.parametrize("tie", [True, False])
def test_conversion_round_trip_pipeline_stages(tie):
    """tp=2 x pp=2: stages hold their own layers renumbered from 0, merged back bit-exact."""
    from m2flow.workers.engines.megatron.convert import (
        hf_to_megatron,
        megatron_to_hf,
        merge_pipeline_stages,
    )
    from m2flow.workers.engines.megatron.model import megatron_shape

    hf = _hf_model(tie=tie)
    state = hf.state_dict()
    shape = megatron_shape(hf.config, tp=2)
    shards = []
    for r in range(2):
        first = hf_to_megatron(state, shape, r, 2, layer_offset=0, num_layers=1, post_process=False)
        last = hf_to_megatron(state, shape, r, 2, layer_offset=1, num_layers=1, pre_process=False)
        assert "decoder.layers.0.mlp.linear_fc1.weight" in last
        assert "decoder.layers.1.mlp.linear_fc1.weight" not in last
        assert "embedding.word_embeddings.weight" not in last
        assert "output_layer.weight" in last  # tied: the last stage keeps its own copy
        shards.append(merge_pipeline_stages([first, last], [1, 1]))
    back = megatron_to_hf(shards, shape)
    assert set(back) == set(state)
    for k, v in state.items():
        assert torch.equal(back[k], v), k


def test_qkv_layout_groups_queries_with_their_kv_head():
    """Megatron's fused QKV rows: per KV group, its query heads then its key then its value."""
    from m2flow.workers.engines.megatron.convert import hf_to_megatron
    from m2flow.workers.engines.megatron.model import megatron_shape

    hf = _hf_model()
    state = hf.state_dict()
    shape = megatron_shape(hf.config, tp=2)
    d = shape.head_dim
    a = "model.layers.0.self_attn."
    rank1 = hf_to_megatron(state, shape, tp_rank=1, tp_size=2)
    qkv = rank1["decoder.layers.0.self_attention.linear_qkv.bias"]  # group 1 only
    assert torch.equal(qkv[: 2 * d], state[a + "q_proj.bias"][2 * d : 4 * d])
    assert torch.equal(qkv[2 * d : 3 * d], state[a + "k_proj.bias"][d : 2 * d])
    assert torch.equal(qkv[3 * d :], state[a + "v_proj.bias"][d : 2 * d])


def test_megatron_to_hf_loads_into_hf_model():
    from m2flow.workers.engines.megatron.convert import hf_to_megatron, megatron_to_hf
    from m2flow.workers.engines.megatron.model import megatron_shape

    src, dst = _hf_model(tie=False, seed=0), _hf_model(tie=False, seed=5)
    shape = megatron_shape(src.config, tp=2)
    shards = [hf_to_megatron(src.state_dict(), shape, r, 2) for r in range(2)]
    dst.load_state_dict(megatron_to_hf(shards, shape))
    for (k, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), k


# -- (b) TP=1 forward parity in this process --------------------------------------------------


@cpu_only
@pytest.mark.parametrize("tie", [True, False])
def test_tp1_logprobs_match_hf(single_rank_group, tie):
    from m2flow.workers.engines.megatron.convert import (
        hf_to_megatron,
        load_megatron_state,
        megatron_state,
        megatron_to_hf,
    )
    from m2flow.workers.engines.megatron.model import build_gpt_model, megatron_sequence_logprobs

    hf = _hf_model(tie=tie).eval()
    mg = build_gpt_model(hf.config).eval()
    load_megatron_state(mg, hf_to_megatron(hf.state_dict(), mg.m2flow_shape))
    # The live model's state converts back exactly too (names and layout as Megatron builds them).
    back = megatron_to_hf([megatron_state(mg)], mg.m2flow_shape)
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
    batch = _batch(hf.config.vocab_size)
    with torch.no_grad():
        want = sequence_logprobs(hf, *_keys(batch))
        got = megatron_sequence_logprobs(mg, *_keys(batch))
    torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=0)


# -- (c) TP=2 (and TP=2 x DP=2) over gloo: logprobs, loss, one AdamW step ---------------------


def _hf_step(hf, batch):
    """Logprobs, loss and the state after one AdamW step of the torch engine on one rank."""
    opt = torch.optim.AdamW(hf.parameters(), **ADAMW)
    logprobs = sequence_logprobs(hf, *_keys(batch))
    loss, _ = grpo_loss(
        logprobs, batch["old_logprobs"], batch["advantages"], batch["response_mask"]
    )
    opt.zero_grad()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in hf.named_parameters()}
    opt.step()
    return (
        logprobs.detach(),
        loss.detach(),
        grads,
        {k: v.clone() for k, v in hf.state_dict().items()},
    )


@cpu_only
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("tp", "pp", "dp", "tie"),
    [(2, 1, 1, True), (1, 2, 1, True), (1, 2, 1, False), (2, 1, 2, True)],
    ids=["tp2", "pp2-tied", "pp2-untied", "tp2-dp2"],
)
def test_parallel_step_matches_hf(tmp_path, tp, pp, dp, tie):
    """TP / PP / DP Megatron over gloo vs the torch engine on one rank: logprobs, loss, grads,
    and weights after one AdamW step (shards gathered back to HF layout)."""
    from m2flow.workers.engines.megatron.model import megatron_shape
    from m2flow.workers.engines.megatron.parity import spawn_parity

    hf = _hf_model(tie=tie)
    batch = _batch(hf.config.vocab_size)
    with torch.no_grad():  # behaviour policy slightly off the current one: ratios != 1
        old = sequence_logprobs(hf, *_keys(batch))
        g = torch.Generator().manual_seed(7)
        batch["old_logprobs"] = (old + 0.05 * torch.randn(old.shape, generator=g)) * batch[
            "response_mask"
        ]
    torch.save(
        {"hf_config": hf.config, "hf_state": hf.state_dict(), "batch": batch, "adamw": ADAMW},
        tmp_path / "case.pt",
    )
    spawn_parity(tmp_path, tp=tp, dp=dp, pp=pp, timeout_s=200)
    want_lp, want_loss, want_grads, want_state = _hf_step(hf, batch)

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(tp * pp * dp)]
    last = [r for r in ranks if "loss" in r]  # the last pipeline stage computes the loss
    assert len(last) == tp * dp
    loss = sum(r["loss"] for r in last if r["tp_rank"] == 0)  # DP shares of one global loss
    torch.testing.assert_close(loss, want_loss, atol=LOGPROB_ATOL, rtol=0)
    for r in last:
        torch.testing.assert_close(r["logprobs"], want_lp[r["rows"]], atol=LOGPROB_ATOL, rtol=0)

    shape = megatron_shape(hf.config, tp=tp)
    for dp_rank in range(dp):
        grads = _gathered(ranks, "grads", dp_rank, tp, shape)
        state = _gathered(ranks, "state", dp_rank, tp, shape)
        for k, v in want_grads.items():
            torch.testing.assert_close(grads[k], v, atol=1e-6, rtol=1e-4, msg=k)
        for k, v in want_state.items():
            torch.testing.assert_close(state[k], v, atol=WEIGHT_ATOL, rtol=0, msg=k)


@cpu_only
@pytest.mark.timeout(240)
def test_engine_pp2_kl_padded_micro_batches_match_torch_engine(tmp_path):
    """The actor's engine (``MegatronEngine``) at TP=1 x PP=2, tied embeddings, ``kl_coef``
    0.1 against its frozen reference shard, offload/onload before each call: two ``train``
    calls (mini-batches of 6 in micro-batches of 4, then the whole batch of 10 in micro-batches
    of 4: short micro-batches padded for the schedule) vs the torch engine's GRPO update
    (``test_llm.train_on_batch``) with reference logprobs from a frozen copy, as the torch actor
    computes them: metrics (loss incl. the KL term, kl, grad_norm) and weights."""
    import copy

    from m2flow.workers.engines.megatron.parity import engine_rank, spawn_parity
    from m2flow.workers.engines.torch_engine import TorchEngine
    from test_llm import loss_args, train_on_batch

    hf = _hf_model(tie=True)
    reference = copy.deepcopy(hf).eval()  # only infer: its AdamW never steps
    batch = _batch(hf.config.vocab_size, b=10)
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
    spawn_parity(tmp_path, tp=1, pp=2, timeout_s=200, target=engine_rank)
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
    print("engine PP2 KL vs torch engine:", {k: f"{v:.2g}" for k, v in diffs.items()})
    assert all(diffs[k] <= LOGPROB_ATOL for k in ("loss", "pg_loss", "kl", "grad_norm")), diffs
    # three AdamW steps at lr=1e-3: rounding in tiny gradients amplified thrice (see above)
    assert diffs["weights"] <= 3 * WEIGHT_ATOL, diffs


def _gathered(ranks, key, dp_rank, tp, shape):
    """HF-layout tensors of one DP replica: pipeline stages merged per TP rank, TP gathered."""
    from m2flow.workers.engines.megatron.convert import megatron_to_hf, merge_pipeline_stages

    shards = []
    for t in range(tp):
        stages = sorted(
            (r for r in ranks if r["dp_rank"] == dp_rank and r["tp_rank"] == t),
            key=lambda r: r["pp_rank"],
        )
        shards.append(
            merge_pipeline_stages([r[key] for r in stages], [r["layers"] for r in stages])
        )
    return megatron_to_hf(shards, shape)


def test_shims_are_noops_with_cuda_and_patch_on_cpu():
    from m2flow.workers.engines.megatron import shims

    if torch.cuda.is_available():
        assert shims.apply_cpu_shims() is False
    else:
        assert shims.apply_cpu_shims() is True
        assert torch.cuda.current_device() == torch.device("cpu")
