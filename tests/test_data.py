"""Your own data (``data.*``): files read with Hugging Face ``datasets``, prompts formatted for
the tokenizer, the prompt limit, the seeded epoch sampler and its place in a checkpoint.

Real parts only: JSONL/JSON/Parquet files written to tmp dirs, the character tokenizer and
Qwen2's (with its chat template, built offline), real ``Checkpoints`` files. No Ray."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest
from m2flow.workers.data.files import char_limit, load_items
from m2flow.workers.data.item import PromptItem, limit_prompts, prompt_items
from m2flow.workers.data.reasoning_gym import task_items
from m2flow.workers.data.sampler import PromptSampler, load_sampler
from m2flow.workers.data.splits import run_data
from m2flow.workers.llm import build_char_tokenizer, build_qwen2_tokenizer
from m2flow.workers.tasks import TaskDataset

from m2flow.core.config import ConfigError
from m2flow.run.recipe import Checkpoints
from m2flow.run.workflow import prepare

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "workflows" / "grpo.py"
PPO = ROOT / "workflows" / "ppo.py"
CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


@pytest.fixture(scope="module")
def char():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def qwen():
    return build_qwen2_tokenizer()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def verl_rows(n: int, split: str = "train", start: int = 0) -> list[dict]:
    """chain_sum-like rows in veRL's columns, string prompts (``"3+4="``)."""
    return [
        {
            "data_source": "chain_sum",
            "prompt": f"{i % 10}+{(i * 7) % 10}=",
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i % 10 + (i * 7) % 10)},
            "extra_info": {"split": split, "index": i},
        }
        for i in range(start, start + n)
    ]


# ---------------------------------------------------------------------------- files


def test_jsonl_custom_nested_keys_with_string_prompts(tmp_path, char):
    """Dotted keys reach into nested columns; a string prompt is the text as-is, tokenized with
    the tokenizer's special tokens (the char tokenizer's <bos>)."""
    rows = [
        {"q": {"text": f"{i}+1="}, "label": {"gold": {"value": str(i + 1)}}, "src": "mine",
         "meta": {"i": i}}
        for i in range(4)
    ]  # fmt: skip
    f = write_jsonl(tmp_path / "custom.jsonl", rows)
    keys = {"prompt_key": "q.text", "answer_key": "label.gold.value",
            "data_source_key": "src", "extra_info_key": "meta"}  # fmt: skip
    items, dropped = load_items(str(f), char, **keys)
    assert dropped == 0 and len(items) == 4
    for i, it in enumerate(items):
        assert it.prompt == f"{i}+1=" and it.prompt_ids == char(f"{i}+1=").input_ids
        assert it.prompt_ids[0] == char.bos_token_id
        assert (it.ground_truth, it.data_source, it.extra_info, it.index) == (
            str(i + 1), "mine", {"i": i}, i,
        )  # fmt: skip
    assert items[2].entry() == {
        "data_source": "mine", "ground_truth": "3", "extra_info": {"i": 2}, "index": 2,
    }  # fmt: skip
    # The default keys do not find these columns: the error names the row and the fix.
    with pytest.raises(ConfigError, match=r"custom.jsonl row 0 has no prompt at 'prompt'.*"
                                          r"data.prompt_key"):  # fmt: skip
        load_items(str(f), char)
    with pytest.raises(ConfigError, match=r"row 0 has no ground truth at 'label.x'.*answer_key"):
        load_items(str(f), char, **{**keys, "answer_key": "label.x"})


def test_parquet_messages_through_the_chat_template(tmp_path, qwen):
    """veRL's columns in Parquet: message prompts go through the chat template with the
    assistant turn opened, tokenized once without special tokens; a row without
    reward_model.ground_truth falls back to the top-level answer; no data_source: ""."""
    messages = [
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "2+2?"}],
        [{"role": "user", "content": "Capital of France?"}],
    ]
    pd.DataFrame(
        {"prompt": messages, "answer": ["4", "Paris"], "extra_info": [{"k": 1}, {"k": 2}]}
    ).to_parquet(tmp_path / "chat.parquet")
    items, _ = load_items(str(tmp_path / "chat.parquet"), qwen)
    for it, msgs in zip(items, messages):
        text = qwen.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert it.prompt == text and text.endswith("<|im_start|>assistant\n")
        assert it.prompt_ids == qwen(text, add_special_tokens=False).input_ids
        assert it.prompt_ids.count(qwen.convert_tokens_to_ids("<|im_start|>")) == len(msgs) + 1 + (
            msgs[0]["role"] != "system"
        )  # the template's default system turn where none is given
    assert [it.ground_truth for it in items] == ["4", "Paris"]
    assert [it.data_source for it in items] == ["", ""]
    assert [it.extra_info for it in items] == [{"k": 1}, {"k": 2}]


def test_a_list_of_files_in_order_and_one_index(tmp_path, char):
    """A list of files (JSONL, JSON, Parquet) is read in order; index counts over them all."""
    a = write_jsonl(tmp_path / "a.jsonl", verl_rows(3))
    (tmp_path / "b.json").write_text(json.dumps(verl_rows(2, start=3)))
    pd.DataFrame(verl_rows(2, start=5)).to_parquet(tmp_path / "c.parquet")
    files = [str(a), str(tmp_path / "b.json"), str(tmp_path / "c.parquet")]
    items, _ = load_items(files, char)
    assert [it.index for it in items] == list(range(7))
    assert [it.extra_info["index"] for it in items] == list(range(7))
    assert [it.prompt for it in items] == [r["prompt"] for r in verl_rows(7)]
    one, _ = load_items(str(a), char)
    assert [it.prompt_ids for it in one] == [it.prompt_ids for it in items[:3]]


def test_ground_truth_falls_back_row_by_row(tmp_path, char):
    """Rows of one file may differ: Arrow fills the columns a row lacks with null, and a null
    reward_model.ground_truth falls back to that row's answer."""
    rows = [{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}},
            {"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3="}]  # fmt: skip
    f = write_jsonl(tmp_path / "mixed.jsonl", rows)
    with pytest.raises(ConfigError, match=r"mixed.jsonl row 2 has no ground truth .*nor an "):
        load_items(str(f), char)
    items, _ = load_items(str(write_jsonl(f, rows[:2])), char)
    assert [it.ground_truth for it in items] == ["2", "4"]


def test_file_errors_name_the_file_row_and_fix(tmp_path, char):
    with pytest.raises(ConfigError, match=r"nope.jsonl' does not exist"):
        load_items(str(tmp_path / "nope.jsonl"), char)
    with pytest.raises(ConfigError, match=r"not a data file .* \.jsonl, \.json, \.parquet"):
        load_items(str(tmp_path / "a.csv"), char)
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "1+1="}],
                                                  "answer": "2"}])  # fmt: skip
    with pytest.raises(ConfigError, match=r"chat.jsonl row 0: .*no chat template: use a tokenizer "
                                          r"with one \(model.tokenizer=qwen2\)"):  # fmt: skip
        load_items(str(chat), char)
    letters = write_jsonl(
        tmp_path / "letters.jsonl",
        [{"prompt": "1+1=", "answer": "2"}, {"prompt": "one+1=", "answer": "2"}],
    )
    with pytest.raises(ConfigError, match=r"letters.jsonl row 1's prompt has characters .*'eno'"):
        load_items(str(letters), char)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": 7, "answer": "7"}])
    with pytest.raises(ConfigError, match=r"bad.jsonl row 0: the prompt is a int"):
        load_items(str(bad), char)


def test_overlong_prompts_error_or_drop(tmp_path, char):
    """A prompt over the limit stops the run (file, row, length, limit, fix), or with
    overlong_prompts=drop is left out and counted; run_data logs the count."""
    rows = verl_rows(4)
    rows[2]["prompt"] = "1+2+3+4+5="  # 11 tokens with <bos>
    f = write_jsonl(tmp_path / "long.jsonl", rows)
    with pytest.raises(
        ConfigError,
        match=r"long.jsonl: row 2's prompt is 11 tokens > data.max_prompt_tokens=8: raise "
        r"data.max_prompt_tokens .*data.overlong_prompts=drop .*\(1 of 4 here\)",
    ):
        load_items(str(f), char, max_prompt_tokens=8)
    items, dropped = load_items(str(f), char, max_prompt_tokens=8, overlong_prompts="drop")
    assert dropped == 1 and [it.index for it in items] == [0, 1, 3]
    # In a list of files the row is the file's own; index stays global.
    g = write_jsonl(tmp_path / "ok.jsonl", verl_rows(2))
    with pytest.raises(ConfigError, match=r"long.jsonl: row 2's prompt"):
        load_items([str(g), str(f)], char, max_prompt_tokens=8)
    items, dropped = load_items(
        [str(g), str(f)], char, max_prompt_tokens=8, overlong_prompts="drop"
    )
    assert dropped == 1 and [it.index for it in items] == [0, 1, 2, 3, 5]

    over = ["model.max_position_embeddings=20", "rollout.max_new_tokens=12"]  # limit 8
    _, cfg = prepare(str(GRPO), _run(tmp_path, f"data.train_files={f}", *over))
    with pytest.raises(ConfigError, match=r"row 2's prompt is 11 tokens > .*=8"):
        run_data(cfg, char)
    _, cfg = prepare(str(GRPO), _run(tmp_path, f"data.train_files={f}", *over,
                                     "data.overlong_prompts=drop"))  # fmt: skip
    data = run_data(cfg, char)
    assert len(data.train) == 3 and data.heldout == [] and data.source == "files"
    assert any("dropped 1 of 4 prompts of data.train_files" in n for n in data.notes)
    assert any("no held-out evaluation" in n for n in data.notes)


def test_text_checks_and_the_character_bound(tmp_path, char, qwen):
    """A surrogate pair and an escaped backslash before "ud800" are text (only a lone
    surrogate is refused); a prompt of more characters than the limit's tokens can hold
    (limit x the tokenizer's longest token) is refused, or with drop left out and counted,
    before the tokenizer sees it."""
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)  # reading it would wait for a writer forever
    with pytest.raises(ConfigError, match=r"fifo.jsonl' is not a regular file"):
        load_items(str(fifo), char)
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"prompt": "1+2=", "answer": "3", "extra_info": {"note": '
                  '"\\ud83d\\ude00 \\\\ud800"}}\n')  # fmt: skip
    items, _ = load_items(str(ok), char)
    assert items[0].extra_info["note"] == "\U0001f600 \\ud800"
    assert char_limit(char, 8) == 8 * len("<pad>") and char_limit(char, 0) == 0
    assert char_limit(qwen, 10) == 10 * 128  # Qwen2's longest token: 128 spaces
    rows = verl_rows(3)
    rows[1]["prompt"] = "1+" * 20 + "1="  # 42 characters > 8 x 5
    f = write_jsonl(tmp_path / "long.jsonl", rows)
    with pytest.raises(ConfigError, match=r"long.jsonl row 1: the prompt is 42 characters, more "
                       r"than data.max_prompt_tokens=8 tokens can hold \(40: "):  # fmt: skip
        load_items(str(f), char, max_prompt_tokens=8)
    items, dropped = load_items(str(f), char, max_prompt_tokens=8, overlong_prompts="drop")
    assert dropped == 1 and [it.index for it in items] == [0, 2]


def _run(tmp_path: Path, *overrides: str) -> list[str]:
    return [f"trainer.run_dir={tmp_path / 'run'}", *overrides]


def test_config_checks_before_start(tmp_path, char):
    """Config-time: missing files, bad values; the data.* section in both workflows."""
    with pytest.raises(ConfigError, match=r"data.train_files: .*missing.jsonl' does not exist"):
        prepare(str(GRPO), _run(tmp_path, f"data.train_files={tmp_path / 'missing.jsonl'}"))
    with pytest.raises(ConfigError, match="data.overlong_prompts must be error or drop"):
        prepare(str(GRPO), _run(tmp_path, "data.overlong_prompts=truncate"))
    with pytest.raises(ConfigError, match="must fit the model's max_position_embeddings"):
        prepare(str(PPO), _run(tmp_path, "data.max_prompt_tokens=64"))
    # Keys an earlier version had name their new home.
    with pytest.raises(ConfigError, match="task.max_prompt_tokens is now data.max_prompt_tokens"):
        prepare(str(GRPO), _run(tmp_path, "task.max_prompt_tokens=30"))
    with pytest.raises(ConfigError, match="reward.batch_size is now reward_model.batch_size"):
        prepare(str(PPO), _run(tmp_path, "reward.batch_size=8"))
    f = write_jsonl(tmp_path / "t.jsonl", verl_rows(3))
    v = write_jsonl(tmp_path / "v.jsonl", verl_rows(2, "val"))
    _, cfg = prepare(str(PPO), _run(tmp_path, f"data.train_files=[{f},{f}]",
                                    f"data.val_files={v}"))  # fmt: skip
    data = run_data(cfg, char)
    assert len(data.train) == 6 and len(data.heldout) == 2 and not data.notes
    assert data.data_sources() == {"chain_sum"}


def test_reasoning_gym_source_is_the_default(tmp_path, char):
    """Without data files, the task's splits as prompt items: data_source names the task,
    extra_info carries the entry the task's scorer reads, prompts are the task's."""
    over = ["task.train_size=16", "task.heldout_size=4", "task.config.max_digits=1"]
    _, cfg = prepare(str(GRPO), _run(tmp_path, *over))
    data = run_data(cfg, char)
    assert data.source == "reasoning_gym" and (len(data.train), len(data.heldout)) == (16, 4)
    ds = TaskDataset("chain_sum", {**CHAIN_SUM, "max_terms": 3}, seed=1, size=16)
    assert [it.prompt_ids for it in data.train] == [char(it.prompt).input_ids for it in ds.items]
    it = data.train[0]
    assert it.data_source == "reasoning_gym/chain_sum" and it.target == ds.items[0].answer
    assert it.extra_info == {"entry": ds.items[0].entry}
    assert it.ground_truth == ds.items[0].answer
    # The prompt limit applies to this source too (both policies).
    _, cfg = prepare(str(GRPO), _run(tmp_path, *over, "data.overlong_prompts=drop",
                                     "data.max_prompt_tokens=5"))  # fmt: skip
    data = run_data(cfg, char)  # "a+b=" is 5 tokens, "a+b-c=" 7: dropped
    assert data.train and all(len(i.prompt_ids) <= 5 for i in data.train)
    assert any("dropped" in n and "task train split" in n for n in data.notes)


def test_prompt_items_and_limit_helpers(char):
    items = task_items(TaskDataset("chain_sum", CHAIN_SUM, seed=0, size=5), char)
    out = prompt_items(items, [3, 1], step=7)
    assert [o["group"] for o in out] == [0, 1] and all(o["step"] == 7 for o in out)
    assert out[0]["prompt_ids"] == items[3].prompt_ids and out[0]["entry"] == items[3].entry()
    assert set(out[1]["entry"]) == {"data_source", "ground_truth", "extra_info", "index"}
    short = PromptItem([1, 2], "s", "x", index=0)
    long = PromptItem([1, 2, 3], "s", "x", index=1)
    assert limit_prompts([short, long], 0, "error", "w") == ([short, long], 0)  # 0: no limit
    assert limit_prompts([short, long], 2, "drop", "w") == ([short], 1)
    with pytest.raises(ValueError, match="overlong must be one of"):
        limit_prompts([short], 2, "cut", "w")


# ---------------------------------------------------------------------------- sampler


def test_sampler_shuffles_by_seed_and_epoch():
    s = PromptSampler(10, seed=3)
    first, second = s.take(10), s.take(10)
    assert sorted(first) == sorted(second) == list(range(10))  # each epoch: a permutation
    assert first != second and first != list(range(10))  # a new order per epoch
    assert PromptSampler(10, seed=3).take(20) == first + second  # seeded: reproducible
    assert PromptSampler(10, seed=4).take(10) != first
    assert PromptSampler(10, seed=3, shuffle=False).take(12) == [*range(10), 0, 1]
    # A batch crossing the end of an epoch continues into the next epoch's permutation.
    s = PromptSampler(10, seed=3)
    assert s.take(4) + s.take(4) + s.take(4) == (first + second)[:12]
    assert s.state_dict() == {"epoch": 1, "offset": 2, "size": 10}
    # A batch larger than the split spans epochs.
    assert PromptSampler(3, seed=0).take(7) == PromptSampler(3, seed=0).take(9)[:7]
    with pytest.raises(ValueError, match="at least one item"):
        PromptSampler(0)


def test_sampler_state_round_trip():
    s = PromptSampler(7, seed=1)
    s.take(9)
    state = s.state_dict()
    t = PromptSampler(7, seed=1)
    t.load_state_dict(json.loads(json.dumps(state)))
    assert t.take(12) == s.take(12)
    with pytest.raises(ValueError, match="over 7 prompts, this run's training data has 8"):
        PromptSampler(8, seed=1).load_state_dict(state)


def test_resume_mid_epoch_takes_the_next_batch(tmp_path):
    """Through real checkpoint files: a run stopped mid-epoch and resumed takes exactly the
    batch an uninterrupted run takes next (also across the epoch's end)."""
    size, per_step = 10, 4
    whole = PromptSampler(size, seed=5)
    uninterrupted = [whole.take(per_step) for _ in range(5)]

    first = PromptSampler(size, seed=5)
    for _ in range(2):  # steps 1-2, then the run stops (offset 8 of epoch 0)
        first.take(per_step)
    Checkpoints(tmp_path).save(2, {}, {"data": first.state_dict()})
    step, state = Checkpoints(tmp_path).restore({})
    assert step == 2 and state["data"] == {"epoch": 0, "offset": 8, "size": 10}
    resumed = PromptSampler(size, seed=5)
    notes = load_sampler(resumed, state)
    assert notes == ["data: resumed at epoch 0, prompt 8 of 10"]
    assert [resumed.take(per_step) for _ in range(3)] == uninterrupted[2:]  # step 3 crosses
    # A checkpoint over other data is refused; one without a position says so.
    with pytest.raises(ConfigError, match="resume with the same data"):
        load_sampler(PromptSampler(11, seed=5), state)
    assert "no data position" in load_sampler(PromptSampler(size), {"step": 2})[0]
