"""Your own model: ``model.path`` loads a local Hugging Face directory in every role.

Real directories written by ``save_pretrained`` into temp dirs: a tiny random Qwen2 with
Qwen2's tokenizer (chat template) and a tiny random Llama with the character tokenizer. Checks
that could fail: the weights and tokenizer come back as saved (fp32 and bf16), the rollout's
logprobs equal the actor's recomputation on the loaded model (fp32), mixed precision keeps
float32 master weights, gradient checkpointing trains alike, bad directories are one-line
errors, and a GRPO run from a directory saves checkpoints ``from_pretrained`` loads.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from m2flow.workers.algos.grpo import grpo_advantages
from m2flow.workers.algos.losses import make_loss
from m2flow.workers.engines.torch_engine import TorchEngine
from m2flow.workers.engines.update import StreamedStep
from m2flow.workers.engines.value_model import ValueModel
from m2flow.workers.llm import (
    build_char_tokenizer,
    build_pretrained_tokenizer,
    build_qwen2_tokenizer,
    build_tokenizer,
    load_model,
    tokenizer_spec,
)
from m2flow.workers.llm.generation import generate, stop_token_ids
from m2flow.workers.llm.model import checkpointing, load_backbone
from m2flow.workers.recipe import ModelConfig, validate_model
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from m2flow.core.config import ConfigError, load_config
from m2flow.core.placement import Placement

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "workflows" / "grpo.py"
SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


def _save(directory: Path, config, tokenizer, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    tok = build_char_tokenizer()
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
               bos_token_id=tok.bos_token_id)  # fmt: skip
    config = LlamaConfig(vocab_size=len(tok), tie_word_embeddings=False, **SHAPE, **ids)
    return _save(tmp_path_factory.mktemp("llama"), config, tok, seed=1)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    tok = build_qwen2_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), tie_word_embeddings=True, **SHAPE,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    return _save(tmp_path_factory.mktemp("qwen2"), config, tok, seed=2)


@pytest.fixture(params=["llama", "qwen2"])
def model_dir(request, llama_dir, qwen2_dir) -> Path:
    return {"llama": llama_dir, "qwen2": qwen2_dir}[request.param]


def _prompts(tok) -> list[list[int]]:
    if tok.chat_template:
        msgs = [[{"role": "user", "content": q}] for q in ("What is 2+3?", "Say hi")]
        texts = [
            tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in msgs
        ]
        return [tok(t, add_special_tokens=False).input_ids for t in texts]
    return [tok(p).input_ids for p in ("1+2=", "12+34-5=")]


def test_weights_and_tokenizer_come_back_as_saved(model_dir):
    want = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    got = load_model({"path": str(model_dir)}, None)
    assert type(got) is type(want) and got.dtype == torch.float32
    for (n, a), (_, b) in zip(want.state_dict().items(), got.state_dict().items()):
        assert torch.equal(a, b), n
    spec = tokenizer_spec({"path": str(model_dir)})
    assert spec == {"name": "pretrained", "path": str(model_dir)}
    tok = build_tokenizer(spec)
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    original = build_qwen2_tokenizer() if "qwen2" in model_dir.name else build_char_tokenizer()
    text = "98+93-77= 12" if tok.chat_template is None else "Hi there, 2+3=5 <answer>5</answer>"
    assert tok(text).input_ids == original(text).input_ids
    assert tok.chat_template == original.chat_template
    # The model's stop tokens: the tokenizer's EOS (and the generation config's).
    assert stop_token_ids(tok, got.generation_config) == [original.eos_token_id]


def test_loading_a_directory_prints_no_progress_bar(llama_dir, capsys):
    """transformers' "Loading weights" bar, once per worker process on the run's console, is
    off where m2flow loads a directory (the switch is per process, as in a worker)."""
    load_model({"path": str(llama_dir)}, None)
    load_backbone({"path": str(llama_dir)}, None)
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "it/s" not in err, err[-500:]


def test_bf16_for_inference_float32_for_training(llama_dir):
    bf16 = load_model({"path": str(llama_dir), "dtype": "bfloat16"}, None)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    fp32 = load_model({"path": str(llama_dir), "dtype": "bfloat16"}, None, trainable=True)
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}  # master weights
    # auto: float32 on the CPU
    auto = load_model({"path": str(llama_dir)}, None)
    assert next(auto.parameters()).dtype == torch.float32
    # The bf16 copy is the fp32 weights rounded.
    w32 = fp32.model.layers[0].mlp.up_proj.weight
    assert torch.equal(bf16.model.layers[0].mlp.up_proj.weight, w32.to(torch.bfloat16))


def test_rollout_logprobs_equal_the_actors_on_a_loaded_model(model_dir):
    """fp32: the HF rollout's per-token logprobs = the actor's recomputation (<= 1e-4)."""
    tok = build_tokenizer(tokenizer_spec({"path": str(model_dir)}))
    model = load_model({"path": str(model_dir)}, tok)
    out = generate(model, tok, _prompts(tok), n_samples=4, max_new_tokens=8, temperature=0.8,
                   sample_keys=[(1, 0), (1, 1)], seed=3)  # fmt: skip
    assert out["response_mask"].sum() > 8  # real responses
    actor = TorchEngine.from_module(
        load_model({"path": str(model_dir)}, tok, trainable=True), temperature=0.8
    )
    lp = actor.infer(out)
    assert (lp - out["logprobs"]).abs().max() <= 1e-4


def test_mixed_precision_and_gradient_checkpointing_train(llama_dir):
    """bf16 autocast over float32 master weights takes a finite step near the fp32 one;
    gradient checkpointing (full-sequence training forward) gives the fp32 step's update."""
    tok = build_char_tokenizer()
    path = str(llama_dir)
    rollout = load_model({"path": path}, tok)
    out = generate(rollout, tok, _prompts(tok), n_samples=4, max_new_tokens=6, temperature=1.0,
                   sample_keys=[(1, 0), (1, 1)], seed=0)  # fmt: skip
    data = {k: out[k] for k in KEYS}
    rewards = (out["response_ids"][:, 0] % 2).float()
    data["advantages"] = grpo_advantages(rewards, out["group_index"])
    data["old_logprobs"] = out["logprobs"]
    assert data["advantages"].abs().sum() > 0

    def grads(**model_kw):
        """The accumulated gradient of the GRPO loss (no optimizer step: AdamW's first step
        would amplify rounding where |grad| ~ its eps)."""
        cfg = {"path": path, **model_kw}
        model = load_model(cfg, tok, trainable=True)
        dtype = torch.bfloat16 if cfg.get("dtype") == "bfloat16" else torch.float32
        engine = TorchEngine.from_module(model, lr=1e-3, temperature=1.0, compute_dtype=dtype)
        step = StreamedStep(engine, make_loss("grpo", "policy"), micro_batch_size=4)
        step.add(data)
        return model, {n: p.grad.clone() for n, p in model.named_parameters()}, step

    base, g32, _ = grads()
    checkpointed, ggc, _ = grads(gradient_checkpointing=True)
    assert checkpointing(checkpointed) and not checkpointing(base)
    for n, g in g32.items():
        # fp32 rounding of two forward layouts (shared prefix vs full sequence): ~1e-6 of max
        assert (ggc[n] - g).abs().max() <= 1e-5 * g.abs().max(), n
    mixed, gbf, trainer = grads(dtype="bfloat16")
    assert {p.dtype for p in mixed.parameters()} == {torch.float32}  # master weights
    assert {g.dtype for g in gbf.values()} == {torch.float32}
    cos = torch.nn.functional.cosine_similarity(
        torch.cat([g.flatten() for g in gbf.values()]),
        torch.cat([g.flatten() for g in g32.values()]),
        dim=0,
    )
    assert cos > 0.99  # the same gradient up to bf16 rounding of the forward
    metrics = trainer.finish()
    assert metrics["steps"] == 1 and torch.isfinite(torch.tensor(metrics["loss"]))
    assert {p.dtype for p in mixed.parameters()} == {torch.float32}


def test_critic_trunk_is_the_pretrained_one(llama_dir):
    tok = build_char_tokenizer()
    critic = ValueModel({"path": str(llama_dir)}, tok)
    policy = AutoModelForCausalLM.from_pretrained(llama_dir)
    for n, p in critic.backbone.state_dict().items():
        assert torch.equal(p, policy.model.state_dict()[n]), n
    assert float(critic.head.weight.abs().sum()) == 0.0  # V = 0 before any update
    critic.load_backbone(policy.state_dict())  # the policy's keys fit (model. prefix)


def test_bad_directories_are_one_line_errors(tmp_path, llama_dir):
    def check(path, **extra):
        section = {"path": str(path), **extra}
        cfg = load_config(ModelOnly, [f"model.{k}={v}" for k, v in section.items()])
        validate_model(cfg.model)

    with pytest.raises(ConfigError, match="no such directory"):
        check(tmp_path / "nope")
    with pytest.raises(ConfigError, match="no config.json"):
        check(tmp_path)
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(
        json.dumps({"model_type": "llama", "auto_map": {"AutoModel": "x.Y"}})
    )
    with pytest.raises(ConfigError, match="custom code"):
        check(remote)
    vit = tmp_path / "vit"
    vit.mkdir()
    (vit / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(ConfigError, match="not a causal LM"):
        check(vit)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match="no weights"):
        check(bare)
    notok = tmp_path / "notok"
    notok.mkdir()
    for f in ("config.json", "model.safetensors"):
        (notok / f).write_bytes((llama_dir / f).read_bytes())
    with pytest.raises(ConfigError, match="no tokenizer files"):
        check(notok)
    check(notok, tokenizer="char")  # another tokenizer named: fine
    with pytest.raises(ConfigError, match="model.dtype"):
        check(llama_dir, dtype="float8")
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        build_pretrained_tokenizer(str(notok))


@dataclass
class ModelOnly:
    model: ModelConfig = field(default_factory=ModelConfig)


@pytest.mark.parametrize("workflow", ["grpo", "ppo"])
def test_an_unset_generation_length_comes_from_the_model(tmp_path, llama_dir, workflow):
    """``rollout.max_new_tokens`` unset: 6 for the built-in model on its task, silently; with
    ``model.path``, the directory's generation_config.json ``max_new_tokens``, else half its
    context, and a note says which; with data files, the built-in 6 and a note. A value the
    user sets is kept without a note, and the prompt limit follows the value taken."""
    from m2flow.workers.data.config import prompt_limit
    from m2flow.workers.recipe import rollout_options

    from m2flow.run.workflow import prepare

    def section(*over):
        cfg = prepare(ROOT / "workflows" / f"{workflow}.py",
                      [f"trainer.run_dir={tmp_path / 'run'}", *over])[1]  # fmt: skip
        assert cfg.rollout.max_new_tokens is None or over  # unset stays None in the config
        opts, note = rollout_options(cfg)
        return opts.max_new_tokens, note, prompt_limit(cfg)

    assert section() == (6, "", 64 - 6)  # the main job's: unchanged, nothing printed
    n, note, limit = section(f"model.path={llama_dir}")
    assert (n, limit) == (32, 64 - 32)  # SHAPE's 64 positions
    assert note.startswith("rollout.max_new_tokens: 32 (half the model's context of 64 tokens")
    assert "rollout.max_new_tokens=N" in note
    own = tmp_path / "own"
    shutil.copytree(llama_dir, own)
    gen = json.loads((own / "generation_config.json").read_text())
    (own / "generation_config.json").write_text(json.dumps({**gen, "max_new_tokens": 20}))
    n, note, limit = section(f"model.path={own}")
    assert (n, limit) == (20, 64 - 20) and "generation_config.json" in note, note
    assert section(f"model.path={own}", "rollout.max_new_tokens=9") == (9, "", 64 - 9)
    rows = tmp_path / "train.jsonl"
    rows.write_text(json.dumps({"prompt": "1+2=", "reward_model": {"ground_truth": "3"}}) + "\n")
    n, note, _ = section(f"data.train_files={rows}")
    assert n == 6 and "the built-in model's default" in note, note


@pytest.mark.e2e
def test_grpo_from_a_model_directory_saves_loadable_checkpoints(
    cluster, llama_dir, tmp_path, capsys
):
    """The runner with ``model.path``: no warm start (a pretrained model starts from its
    weights), held-out accuracy at step 0, two GRPO steps, and a checkpoint that
    ``AutoModelForCausalLM.from_pretrained`` loads as the directory's architecture."""
    from m2flow.run.workflow import run_workflow

    run_dir = tmp_path / "run"
    overrides = [
        f"model.path={llama_dir}",
        f"trainer.run_dir={run_dir}",
        "trainer.steps=2",
        "trainer.save_every=2",
        "trainer.eval_every=2",
        "trainer.prompts_per_step=4",
        "rollout.n_samples=4",
        "rollout.threads=1",
        "actor.threads=1",
        "task.train_size=64",
        "task.heldout_size=16",
    ]
    run_workflow(GRPO, overrides)
    out = capsys.readouterr().out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 0 and records[0]["phase"] == "start"
    # rollout.max_new_tokens unset: half the directory's 64 positions, said on the console;
    # the random weights rarely stop early, so responses run past the built-in model's 6
    assert "rollout.max_new_tokens: 32 (half the model's context of 64 tokens" in out
    assert max(r["response_length"] for r in records[1:]) > 6, records[1:]
    step0 = next(line for line in out.splitlines() if line.startswith("step 0:"))
    assert "nan" not in step0 and "None" not in step0, step0  # a skipped warm start's loss
    assert "heldout_accuracy" in records[0] and records[-1]["step"] == 2
    saved = run_dir / "checkpoints" / "step_000002" / "actor"
    model = AutoModelForCausalLM.from_pretrained(saved)
    assert type(model).__name__ == "LlamaForCausalLM"
    start = AutoModelForCausalLM.from_pretrained(llama_dir)
    moved = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), start.parameters()))
    assert moved > 0  # trained
    tok = build_pretrained_tokenizer(str(saved))
    assert tok("1+2=").input_ids == build_char_tokenizer()("1+2=").input_ids


def _save_classifier(directory: Path, tok, num_labels: int = 1) -> Path:
    from transformers import LlamaForSequenceClassification

    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
               bos_token_id=tok.bos_token_id)  # fmt: skip
    config = LlamaConfig(vocab_size=len(tok), num_labels=num_labels, **SHAPE, **ids)
    torch.manual_seed(4)
    LlamaForSequenceClassification(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def test_reward_model_from_a_classifier_scores_like_it(tmp_path):
    """``ValueModel.from_classifier``: the classifier's trunk and score head; the sequence
    score at the last real token of a padded batch equals the classifier's head on the
    unpadded sequence's last position."""
    from m2flow.workers.engines.value_model import ValueModel, sequence_scores
    from transformers import AutoModelForSequenceClassification

    tok = build_char_tokenizer()
    path = _save_classifier(tmp_path / "rm", tok)
    rm = ValueModel.from_classifier(str(path))
    clf = AutoModelForSequenceClassification.from_pretrained(path)
    prompts = [tok("1+2=").input_ids, tok("12+34-5=").input_ids]
    policy = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=len(tok), **SHAPE))
    out = generate(policy, tok, prompts, n_samples=2, max_new_tokens=5, temperature=1.0)
    with torch.no_grad():
        got = sequence_scores(rm, *(out[k] for k in KEYS))
        for i in range(len(got)):
            ids = torch.cat([out["prompt_ids"][i][out["prompt_mask"][i] == 1],
                             out["response_ids"][i][out["response_mask"][i] == 1]])  # fmt: skip
            # the classifier's head on its trunk's last position (its own pooling finds the
            # last token by pad id, which a sampled response may contain)
            want = clf.score(clf.model(input_ids=ids[None]).last_hidden_state)[0, -1, 0]
            assert float((got[i] - want).abs()) < 1e-5


def test_reward_model_path_is_checked_before_start(tmp_path, llama_dir):
    from m2flow.run.workflow import prepare

    tok = build_char_tokenizer()
    base = [f"model.path={llama_dir}", f"trainer.run_dir={tmp_path / 'run'}"]
    two = _save_classifier(tmp_path / "two", tok, num_labels=2)
    with pytest.raises(ConfigError, match="2 labels"):
        prepare(str(ROOT / "workflows" / "ppo.py"), [*base, f"reward_model.path={two}"])
    other = _save_classifier(tmp_path / "other", build_char_tokenizer("0123456789"))
    with pytest.raises(ConfigError, match="vocabulary differs"):
        prepare(str(ROOT / "workflows" / "ppo.py"), [*base, f"reward_model.path={other}"])
    with pytest.raises(ConfigError, match="not a causal LM|no sequence classifier|no such"):
        prepare(str(ROOT / "workflows" / "ppo.py"), [*base, f"reward_model.path={tmp_path}/x"])
    # the model directory's checks: sizes in bounds and agreeing with the weights' headers
    deep = _save_classifier(tmp_path / "deep", tok)
    config = json.loads((deep / "config.json").read_text())
    (deep / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ConfigError, match=r"reward_model.path=.*deep: config.json says "
                       r"num_hidden_layers=3, but the weights hold 2 layers"):  # fmt: skip
        prepare(str(ROOT / "workflows" / "ppo.py"), [*base, f"reward_model.path={deep}"])
    (deep / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**6}))
    with pytest.raises(ConfigError, match=r"num_hidden_layers=1000000: a size must be"):
        prepare(str(ROOT / "workflows" / "ppo.py"), [*base, f"reward_model.path={deep}"])


@pytest.mark.e2e
def test_ppo_from_directories_with_your_reward_model(cluster, llama_dir, tmp_path):
    """PPO with actor, reference, critic trunk and rollout from ``model.path`` and the reward
    model from ``reward_model.path``: no warm start, no reward-model fit, the reward model's
    weights untouched by the steps. On one device: one rank per group, each loading its
    directory (the GRPO test above loads on two ranks)."""
    from m2flow.run.workflow import run_workflow

    tok = build_char_tokenizer()
    rm_dir = _save_classifier(tmp_path / "rm", tok)
    run_dir = tmp_path / "run"
    overrides = [
        f"model.path={llama_dir}", f"reward_model.path={rm_dir}", f"trainer.run_dir={run_dir}",
        "trainer.steps=2", "trainer.save_every=2", "trainer.eval_every=2",
        "trainer.prompts_per_step=4", "rollout.n_samples=4", "task.train_size=64",
        "task.heldout_size=16", "actor.mini_batch_size=8", "critic.mini_batch_size=8",
        "algorithm.epochs=1", "rollout.threads=1", "actor.threads=1", "critic.threads=1",
        "reference.threads=1", "reward_model.threads=1",
    ]  # fmt: skip
    one_device = Placement(mode="temporal", default_devices=[0])
    run_workflow(ROOT / "workflows" / "ppo.py", overrides, plan=one_device)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["phase"] == "start" and not any(k.startswith("rm_") for k in records[0])
    assert all(0 < r["rm_mean"] < 1 for r in records[1:])
    from m2flow.workers.checkpoint import load_state
    from transformers import AutoModelForSequenceClassification

    saved = load_state(run_dir / "checkpoints" / "step_000002" / "reward", 0)["model"]
    clf = AutoModelForSequenceClassification.from_pretrained(rm_dir).state_dict()
    assert torch.equal(saved["head.weight"], clf["score.weight"])
    for name, w in clf.items():
        if name.startswith("model."):
            assert torch.equal(saved["backbone." + name[len("model.") :]], w), name
