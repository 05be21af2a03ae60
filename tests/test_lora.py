"""LoRA on the torch engine (``actor.lora``): the options are checked, the optimizer holds the
adapter alone, a weight sync carries the adapter alone and the receivers' merged weights equal
PEFT's merge, a checkpoint is a PEFT adapter directory that resumes exactly, and the GRPO
workflow with ``actor.lora.rank=4`` writes one that ``PeftModel.from_pretrained`` loads and
``m2flow export-merged`` merges."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from m2flow.workers.algos.grpo import grpo_advantages
from m2flow.workers.algos.losses import make_loss
from m2flow.workers.checkpoint import TRAIN_ROLE, load_file, save_file
from m2flow.workers.engines import lora
from m2flow.workers.engines.torch_engine import TorchEngine
from m2flow.workers.engines.update import StreamedStep
from m2flow.workers.llm import build_char_tokenizer, load_model
from m2flow.workers.llm.generation import generate
from transformers import AutoModelForCausalLM, Qwen2Config

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "workflows" / "grpo.py"
KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
OPTIM = {"lr": 1e-2, "temperature": 1.0}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory, tok) -> Path:
    """A pretrained directory: a tiny Qwen2 (tied embeddings) saved by ``save_pretrained``."""
    config = Qwen2Config(
        vocab_size=len(tok), tie_word_embeddings=True, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("qwen2")
    AutoModelForCausalLM.from_config(config).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def data(qwen2_dir, tok) -> dict:
    """A GRPO batch sampled from the directory's model: 2 groups x 4 samples."""
    model = load_model({"path": str(qwen2_dir)}, tok)
    prompts = [tok("1+2=").input_ids, tok("3+4=").input_ids]
    out = generate(model, tok, prompts, n_samples=4, max_new_tokens=6, temperature=1.0,
                   sample_keys=[(1, 0), (1, 1)], seed=0)  # fmt: skip
    batch = {k: out[k] for k in KEYS}
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    batch["advantages"] = grpo_advantages(rewards, out["group_index"])
    batch["old_logprobs"] = out["logprobs"]
    return batch


def _engine(model: dict, tok, **lora_kw) -> TorchEngine:
    return TorchEngine(model, tok, device=CPU, optim=OPTIM, lora={"rank": 4, **lora_kw})


def _step(engine: TorchEngine, data: dict) -> dict:
    step = StreamedStep(engine, make_loss("grpo", "policy"), None)
    step.add(data)
    return step.finish()


@pytest.mark.parametrize(
    "value,message",
    [
        ({"rank": -1}, "actor.lora.rank=-1: give an integer >= 0"),
        ({"rank": 4, "alpha": 0}, "actor.lora.alpha=0: give a number > 0"),
        ({"rank": 4, "dropout": 1.0}, "actor.lora.dropout=1.0: give a number in [0, 1)"),
        ({"rank": 4, "target_modules": []}, "actor.lora.target_modules=[]: name the linear"),
        ({"rnak": 4}, "actor.lora has no option rnak"),
    ],
)
def test_bad_options_are_one_clear_error(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        lora.LoraOptions.from_value(value)


def test_megatron_refuses_lora_by_name_and_torch_takes_it():
    with pytest.raises(ValueError, match="actor.engine=megatron: that engine has no exact LoRA"):
        lora.check_lora("megatron", {"rank": 4})
    lora.check_lora("megatron", {"rank": 0})  # off: nothing to refuse
    lora.check_lora("torch", {"rank": 4})


def test_unknown_target_modules_name_the_models_linear_modules(qwen2_dir, tok):
    with pytest.raises(ValueError, match=r"the model's linear modules are \[.*'q_proj'"):
        _engine({"path": str(qwen2_dir)}, tok, target_modules=["qkv"])


def test_adapter_only_optimizer_and_sync(qwen2_dir, tok, data):
    """The optimizer holds the adapter's parameters only and the base does not move; a sync
    sends the adapter alone after the first; the HF receiver (and the merged fallback) end
    with the weights PEFT's ``merge_and_unload`` gives, bit for bit."""
    engine = _engine({"path": str(qwen2_dir)}, tok)
    trained = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    names = {n for n, p in engine.model.named_parameters() if id(p) in trained}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert len(trained) == sum(p.requires_grad for p in engine.model.parameters())
    base_before = lora.base_state_dict(engine.model)

    receiver = load_model({"path": str(qwen2_dir)}, tok, seed=5)  # its own weights
    torch.nn.init.normal_(receiver.model.embed_tokens.weight)  # not the actor's: the base comes
    fallback = lora.MergedWeights()
    first = engine.weight_payload(base=True)
    lora.apply_payload(receiver, first)
    fallback(first)
    assert _step(engine, data)["steps"] == 1
    second = engine.weight_payload(base=False)
    assert all(k.startswith(lora.PREFIX) for k in second)
    assert lora.payload_bytes(second) * 5 < lora.payload_bytes(first)
    lora.apply_payload(receiver, second)
    merged = fallback(second)

    for k, v in lora.base_state_dict(engine.model).items():
        assert torch.equal(v, base_before[k]), k  # the base is frozen
    want = copy.deepcopy(engine.model).merge_and_unload().state_dict()
    got = engine.get_weights()
    assert set(got) == set(want)
    assert any(not torch.equal(want[k], base_before[k]) for k in want)  # the adapter moved
    for k, v in want.items():
        assert torch.equal(got[k], v), k
        assert torch.equal(receiver.state_dict()[k], v), k
        assert torch.equal(merged[k], v), k


def test_adapter_before_base_is_refused(qwen2_dir, tok):
    engine = _engine({"path": str(qwen2_dir)}, tok)
    with pytest.raises(ValueError, match="without the base weights"):
        lora.apply_payload(load_model({"path": str(qwen2_dir)}, tok), engine.weight_payload(False))


@pytest.mark.parametrize("pretrained", [True, False])
def test_checkpoint_is_a_peft_directory_and_resumes_exactly(
    pretrained, qwen2_dir, tok, data, tmp_path
):
    """Save after one step, restore into a fresh engine (built from another seed: a
    shape-built base comes back from ``base/``), take one more step on both: equal weights and
    optimizer state."""
    from peft import PeftModel

    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip
    model = {"path": str(qwen2_dir)} if pretrained else shape
    a = _engine(model, tok)
    _step(a, data)
    # the role's state file, written and read back (as OnTrainEngine.save_checkpoint does)
    save_file(tmp_path / "actor" / "actor_state.pt", a.save(tmp_path / "actor"))
    state = load_file(tmp_path / "actor" / "actor_state.pt")
    assert (tmp_path / "actor" / "adapter_config.json").exists()
    TRAIN_ROLE(tmp_path / "actor")  # what --resume checks before anything starts
    assert (tmp_path / "actor" / "base").is_dir() is not pretrained
    b = TorchEngine(model, tok, device=CPU, optim=OPTIM, seed=7, lora={"rank": 4})
    b.load(tmp_path / "actor", state)
    assert b.steps == a.steps == 1
    _step(a, data)
    _step(b, data)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), n
    for sa, sb in zip(a.optimizer.state.values(), b.optimizer.state.values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    base = tmp_path / "actor" / "base" if not pretrained else qwen2_dir
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base), tmp_path / "actor"
    )
    saved = lora.merged_state_dict(loaded)
    before = a.get_weights()  # a took one step more than the checkpoint: not equal
    assert any(not torch.equal(saved[k], before[k]) for k in saved)


@pytest.mark.e2e
def test_grpo_smoke_with_lora_saves_a_peft_adapter_and_exports_merged(cluster, tmp_path):
    """The issue's run: ``m2flow run workflows/grpo.py -c smoke actor.lora.rank=4
    trainer.steps=2``; its last checkpoint's actor directory loads with
    ``PeftModel.from_pretrained``, and ``m2flow export-merged`` writes a Hugging Face directory
    whose logits equal the adapted model's."""
    from peft import PeftModel

    from m2flow.run.workflow import run_workflow

    run_dir = tmp_path / "run"
    # the preset's warm start and batches (mixed rewards: the adapter trains); its evaluation
    # splits smaller (CI time)
    overrides = ["actor.lora.rank=4", "trainer.steps=2", f"trainer.run_dir={run_dir}",
                 "rollout.threads=1", "actor.threads=1", "task.val_size=8",
                 "task.heldout_size=8"]  # fmt: skip
    run_workflow(GRPO, overrides, config_files=["smoke"])
    actor = run_dir / "checkpoints" / "step_000002" / "actor"
    base = AutoModelForCausalLM.from_pretrained(actor / "base")
    adapted = PeftModel.from_pretrained(base, actor).eval()
    assert adapted.peft_config["default"].r == 4
    # the adapter names its base where it is after the checkpoint's rename (not step_N.partial)
    ref = json.loads((actor / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(ref) == (actor / "base").resolve()
    out = tmp_path / "merged"
    proc = subprocess.run(
        [sys.executable, "-m", "m2flow.run.cli", "export-merged", str(run_dir), str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in k for k in merged.state_dict())
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        want, got = adapted(ids).logits, merged(ids).logits
    assert (got - want).abs().max() <= 1e-5  # fp32 rounding: (x W0 + s x A^T B^T) vs x W
    plain = AutoModelForCausalLM.from_pretrained(actor / "base").eval()
    with torch.no_grad():
        assert (plain(ids).logits - want).abs().max() > 1e-6  # the adapter changed the model
    again = subprocess.run(
        [sys.executable, "-m", "m2flow.run.cli", "export-merged", str(run_dir), str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert again.returncode == 2 and "exists and is not empty" in again.stderr
