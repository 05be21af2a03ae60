"""A user's model directory, data files and plan file, damaged every way a probe found (issue
35, items 8-10): each case is one line on stderr and exit code 2 from ``m2flow run``, before
Ray starts, with nothing run (no run directory made).

The CLI runs in this process (typer's app; its output captured at the file descriptors, so a
library's warning or a traceback counts as a line too): thirty-odd cases cost one import. No
module here starts Ray, so ``ray.is_initialized()`` after a case says whether that case did.
The damaged inputs are real files built in tmp dirs from a real tiny model directory.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import ray
import torch
from m2flow.workers.llm import build_char_tokenizer
from transformers import AutoModelForCausalLM, LlamaConfig

from m2flow.run.cli import app

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "workflows" / "grpo.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Llama with the character tokenizer, as ``save_pretrained`` writes it (untied
    head, so ``lm_head.weight`` is in the file)."""
    tok = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        tie_word_embeddings=False,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def m2flow_run(capfd, run_dir: Path, *args: str) -> tuple[int, list[str]]:
    """``m2flow run workflows/grpo.py ARGS`` in this process: ``(exit code, the non-empty
    lines it wrote to stdout and stderr)``. A traceback escapes as the exception itself."""
    assert not ray.is_initialized()
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        app(["run", str(GRPO), *args, f"trainer.run_dir={run_dir}", "trainer.steps=1"])
    out = capfd.readouterr()
    return exit_.value.code, [line for line in (out.err + out.out).splitlines() if line.strip()]


def assert_refused(result: tuple[int, list[str]], run_dir: Path, *messages: str) -> None:
    """One line naming the problem, exit code 2, no Ray session, nothing run."""
    code, lines = result
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("config error: "), lines
    for message in messages:
        assert message in lines[0], lines
    assert not ray.is_initialized(), "a user's bad file must be refused before Ray starts"
    # the run directory's lock (m2flow.run.runlock) may be taken before the data are read in main()
    written = sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else []
    assert written in ([], [".lock"]), f"nothing may run, but {run_dir} holds {written}"


# ---------------------------------------------------------------------- the model directory


def _config(**changes) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        config.update(changes)
        (d / "config.json").write_text(json.dumps(config))

    return edit


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda d: (d / name).write_bytes(data)


def _safetensors(edit: Callable[[bytes, dict, bytes], bytes]) -> Callable[[Path], None]:
    """Rewrite model.safetensors from ``edit(length bytes, header, data)``."""

    def rewrite(d: Path) -> None:
        raw = (d / "model.safetensors").read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        (d / "model.safetensors").write_bytes(
            edit(raw[:8], json.loads(raw[8 : 8 + n]), raw[8 + n :])
        )

    return rewrite


def _offsets_beyond_the_file(length: bytes, header: dict, data: bytes) -> bytes:
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] = 2**62
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _replace_weights(make: Callable[[Path], None]) -> Callable[[Path], None]:
    def replace(d: Path) -> None:
        (d / "model.safetensors").unlink()
        make(d / "model.safetensors")

    return replace


RANDOM = bytes(range(128, 256)) * 8  # never UTF-8: every byte is a continuation or lead byte

MODEL_CASES = {
    # item 8: sizes out of bounds, and sizes that disagree with the weights
    "layers 10^6": (
        _config(num_hidden_layers=10**6),
        "num_hidden_layers=1000000: a size must be an integer in [1, 1024]",
    ),
    "hidden 10^9": (_config(hidden_size=10**9), "hidden_size=1000000000: a size must be"),
    "vocab 10^10": (_config(vocab_size=10**10), "vocab_size=10000000000: a size must be"),
    "layers 0": (_config(num_hidden_layers=0), "num_hidden_layers=0: a size must be"),
    "layers -1": (_config(num_hidden_layers=-1), "num_hidden_layers=-1: a size must be"),
    "layers 2.5": (_config(num_hidden_layers=2.5), "num_hidden_layers=2.5: a size must be"),
    "vocab disagrees": (
        _config(vocab_size=18),
        "config.json says vocab_size=18, hidden_size=64, "
        "but the weights' model.embed_tokens.weight is [17, 64]",
    ),
    "hidden disagrees": (
        _config(hidden_size=96, head_dim=24),
        "hidden_size=96, but the weights' model.embed_tokens.weight is [17, 64]",
    ),
    "layers disagree": (
        _config(num_hidden_layers=3),
        "num_hidden_layers=3, but the weights hold 2 layers (model.layers.0 .. model.layers.1)",
    ),
    "untied head missing": (
        _safetensors(lambda n, h, data: _drop_tensor(h, data, "lm_head.weight")),
        "tie_word_embeddings=false, but the weights have no lm_head.weight",
    ),
    # item 9: files that raised tracebacks, or were reported without their name
    "config.json a list": (_write("config.json", b"[1, 2]"), "config.json holds a JSON list"),
    "config.json not JSON": (
        _write("config.json", b"{not json"),
        "config.json is not valid JSON (line 1, column 2",
    ),
    "config.json bytes": (_write("config.json", RANDOM), "config.json is not text (byte 0"),
    "tokenizer.json bytes": (_write("tokenizer.json", RANDOM), "tokenizer.json is not text"),
    "tokenizer_config.json bytes": (
        _write("tokenizer_config.json", RANDOM),
        "tokenizer_config.json is not text",
    ),
    "tokenizer.json of another shape": (
        _write("tokenizer.json", b'{"version": "1.0", "vocab": {"a": 0}}'),
        "the tokenizer files do not load (tokenizer.json: KeyError",
    ),
    "weights truncated": (
        lambda d: (d / "model.safetensors").write_bytes(
            (d / "model.safetensors").read_bytes()[:-1000]
        ),
        "model.safetensors is not a complete safetensors file (Error while deserializing "
        "header: incomplete metadata",
    ),
    "header length 2^62": (
        _safetensors(lambda n, h, data: struct.pack("<Q", 2**62) + json.dumps(h).encode() + data),
        "model.safetensors is not a complete safetensors file",
    ),
    "offsets 2^62": (
        _safetensors(_offsets_beyond_the_file),
        "model.safetensors is not a complete safetensors file",
    ),
    "weights are /dev/zero": (
        _replace_weights(lambda p: p.symlink_to("/dev/zero")),
        "model.safetensors is a character device, not a file of weights",
    ),
    "weights are a FIFO": (_replace_weights(os.mkfifo), "model.safetensors is a FIFO"),
}


def _drop_tensor(header: dict, data: bytes, name: str) -> bytes:
    """A safetensors file without tensor ``name`` (the others' bytes kept, offsets moved)."""
    begin, end = header.pop(name)["data_offsets"]
    for entry in header.values():
        if "data_offsets" in entry and entry["data_offsets"][0] >= end:
            entry["data_offsets"] = [o - (end - begin) for o in entry["data_offsets"]]
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data[:begin] + data[end:]


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_a_damaged_model_directory_is_one_line_before_ray(case, model_dir, tmp_path, capfd):
    damage, message = MODEL_CASES[case]
    d = tmp_path / "model"
    shutil.copytree(model_dir, d)
    damage(d)
    run_dir = tmp_path / "run"
    assert_refused(
        m2flow_run(capfd, run_dir, f"model.path={d}"), run_dir, f"model.path={d}: ", message
    )


def test_undamaged_and_sharded_directories_pass_the_checks(model_dir, tmp_path):
    """The checks refuse the damage, not the layout: the directory the cases start from and
    the same model in shards (``model.safetensors.index.json``) pass; a missing shard does
    not."""
    from m2flow.workers.llm.model_dir import check_model_directory

    from m2flow.run.workflow import prepare

    prepare(str(GRPO), [f"model.path={model_dir}", f"trainer.run_dir={tmp_path / 'run'}"])
    sharded = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.save_pretrained(sharded, max_shard_size="20KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    check_model_directory(str(sharded))
    shards[-1].unlink()
    with pytest.raises(FileNotFoundError, match=f"names 1 missing weight file.*{shards[-1].name}"):
        check_model_directory(str(sharded))


# ---------------------------------------------------------------------- data files

ROW = {"prompt": "1+2=", "reward_model": {"ground_truth": "3"}, "data_source": "chain_sum"}


def _jsonl(*lines: bytes) -> bytes:
    return b"".join(line + b"\n" for line in lines)


GOOD = json.dumps(ROW).encode()
DATA_CASES = {
    # item 9
    "non-UTF-8 bytes": (
        "d.jsonl",
        _jsonl(GOOD, b'{"prompt": "1+\xff=", "answer": "3"}'),
        "d.jsonl line 2: byte 0xff (column 15) is not UTF-8",
    ),
    "empty JSONL": ("d.jsonl", b"", "d.jsonl has no rows"),
    "blank JSONL": ("d.jsonl", b"\n \n", "d.jsonl has no rows"),
    "lone surrogate, nested answer": (
        "d.jsonl",
        _jsonl(GOOD, b'{"prompt": "1+2=\\ud800", "reward_model": {"ground_truth": "3"}}'),
        "d.jsonl line 2: a lone surrogate \\ud800",
    ),
    "lone low surrogate in a JSON list": (
        "d.json",
        b'[{"prompt": "1+2=", "answer": "3"},\n {"prompt": "\\udc00", "answer": "3"}]',
        "d.json line 2: a lone surrogate \\udc00",
    ),
    # item 10
    "empty prompt": (
        "d.jsonl",
        _jsonl(GOOD, json.dumps({**ROW, "prompt": ""}).encode()),
        "d.jsonl row 1: the prompt is empty",
    ),
    "2 MB prompt": (
        "d.jsonl",
        _jsonl(GOOD, json.dumps({**ROW, "prompt": "1+" * 10**6 + "="}).encode()),
        "d.jsonl row 1: the prompt is 2,000,001 characters, more than "
        "data.max_prompt_tokens=58 tokens can hold (290:",
    ),
}


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_a_damaged_data_file_is_one_line_before_ray(case, tmp_path, capfd):
    name, content, message = DATA_CASES[case]
    f = tmp_path / name
    f.write_bytes(content)
    run_dir = tmp_path / "run"
    assert_refused(
        m2flow_run(capfd, run_dir, f"data.train_files={f}"),
        run_dir,
        f"data.train_files: {f}",
        message,
    )


def test_an_empty_prompt_with_qwen2s_tokenizer_is_refused_with_its_row(tmp_path, capfd):
    """Qwen2's tokenizer makes an empty prompt 0 tokens, which passed every check and failed
    the rollout with a reshape error after Ray started."""
    f = tmp_path / "d.jsonl"
    f.write_bytes(_jsonl(GOOD, json.dumps({**ROW, "prompt": ""}).encode()))
    run_dir = tmp_path / "run"
    result = m2flow_run(
        capfd,
        run_dir,
        f"data.train_files={f}",
        "model.tokenizer=qwen2",
        "model.max_position_embeddings=128",
    )
    assert_refused(result, run_dir, f"{f} row 1: the prompt is empty")


# ---------------------------------------------------------------------- a plan file


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "groups:\n  actor: {device: 0}\n",
            "groups.actor is {'device': 0}; groups must be group -> a list of device ids",
        ),
        ("default_devices: {first: 0}\n", "default_devices must be a list of device ids"),
        ("granularity:\n  rollout->actor: many\n", "granularity.rollout->actor is 'many'"),
    ],
)
def test_a_plan_file_of_another_shape_is_one_line_before_ray(text, message, tmp_path, capfd):
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    run_dir = tmp_path / "run"
    assert_refused(
        m2flow_run(capfd, run_dir, f"plan={plan}"), run_dir, f"plan file '{plan}': {message}"
    )
