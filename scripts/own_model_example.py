"""Your own model, data and reward, end to end: writes what a user brings, then prints the run.

    python scripts/own_model_example.py OUT_DIR [--quiet]

Writes into ``OUT_DIR``:

- ``model/``: a Hugging Face model directory (``config.json``, ``model.safetensors``,
  tokenizer files): the main job's tiny Qwen2, warm-started exactly as ``m2flow run
  workflows/grpo.py`` does (supervised on chain_sum until 15 % greedy accuracy on the
  validation split), saved with ``save_pretrained``;
- ``train.jsonl`` and ``val.jsonl``: the main job's chain_sum training items and held-out split
  in veRL's columns (``data_source``, ``prompt``, ``reward_model.ground_truth``,
  ``extra_info``);
- ``reward.py``: a reward function with veRL's signature (1.0 for the exact sum, else 0.0).

and prints the command that trains from them with no warm start (the model is "pretrained"):

    m2flow run workflows/grpo.py model.path=OUT_DIR/model data.train_files=OUT_DIR/train.jsonl
        data.val_files=OUT_DIR/val.jsonl reward.function=OUT_DIR/reward.py:compute_score

A real model works the same way (docs/how-to/own-model.md): a downloaded directory for
``model.path``, Parquet or JSONL files for the data, a reward file or a built-in (``math``,
``exact``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

REWARD = '''"""A reward function with veRL's signature: 1.0 when the response is the exact sum."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    try:
        return 1.0 if int(solution_str.strip()) == int(ground_truth) else 0.0
    except ValueError:  # not a number: no reward (never an exception for a bad response)
        return 0.0
'''


def _rows(items, split: str) -> list[dict]:
    return [
        {
            "data_source": "chain_sum",
            "prompt": it.prompt,  # the compact prompt ("12+3-45="): the char tokenizer's text
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(it.ground_truth)},
            "extra_info": {"split": split, "index": it.index},
        }
        for it in items
    ]


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="directory to write (created)")
    ap.add_argument("--quiet", action="store_true", help="no warm-start progress lines")
    a = ap.parse_args(argv)

    from m2flow.workers.actor.sft import run_sft
    from m2flow.workers.data.reasoning_gym import task_section, task_split
    from m2flow.workers.engines.torch_engine import TorchEngine
    from m2flow.workers.llm import build_model, build_tokenizer, save_checkpoint, tokenizer_spec
    from m2flow.workers.recipe import rollout_options, warm_start_args

    from m2flow.run.recipe import plain
    from m2flow.run.workflow import prepare

    # The main job's own configuration: its task, model shape, warm start and seed.
    with tempfile.TemporaryDirectory() as tmp:
        _, cfg = prepare(ROOT / "workflows" / "grpo.py", [f"trainer.run_dir={tmp}"])
    model_cfg, task = plain(cfg.model), task_section(cfg)
    tokenizer = build_tokenizer(tokenizer_spec(model_cfg))
    train, _ = task_split(task, "train", tokenizer)
    val, _ = task_split(task, "val", tokenizer)
    heldout, _ = task_split(task, "heldout", tokenizer)

    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model = build_model(model_cfg, tokenizer, seed=cfg.trainer.seed)
    ws, _ = warm_start_args(cfg, "reasoning_gym")
    trainer = TorchEngine.from_module(model, lr=ws["lr"])
    res = run_sft(
        trainer, tokenizer, train, steps=ws["steps"], batch_size=ws["batch_size"],
        seed=cfg.trainer.seed, val=val, target_accuracy=ws["target_accuracy"],
        eval_every=ws["eval_every"], time_budget_s=ws["time_budget_s"],
        log=None if a.quiet else print,
    )  # fmt: skip
    # the main job's response cap, as a model directory carries it: an unset
    # rollout.max_new_tokens is taken from here (else half the 64-token context)
    model.generation_config.max_new_tokens = rollout_options(cfg)[0].max_new_tokens
    save_checkpoint(a.out / "model", model, tokenizer)
    for name, items in (("train", train), ("val", heldout)):
        with open(a.out / f"{name}.jsonl", "w") as f:
            for row in _rows(items, name):
                f.write(json.dumps(row) + "\n")
    (a.out / "reward.py").write_text(REWARD)
    print(
        f"wrote {a.out}: model/ (warm start: {res.steps} steps, {res.seconds:.0f} s, val "
        f"accuracy {res.val_accuracy}), train.jsonl ({len(train)} rows), val.jsonl "
        f"({len(heldout)} rows), reward.py; {time.time() - t0:.0f} s in all"
    )
    print(
        "train it:\n  m2flow run workflows/grpo.py "
        f"model.path={a.out}/model data.train_files={a.out}/train.jsonl "
        f"data.val_files={a.out}/val.jsonl reward.function={a.out}/reward.py:compute_score"
    )
    return a.out


if __name__ == "__main__":
    sys.exit(main() and 0)
