"""``m2flow export-merged RUN_DIR OUT``: a run's policy as one Hugging Face directory.

A LoRA run's actor checkpoint is a PEFT adapter directory (:func:`.lora.save_adapter`); this
loads its base, applies the adapter and merges it (PEFT's ``merge_and_unload``: ``W0 +
(alpha / r) * B A``), and writes the merged model with the run's tokenizer, which
``AutoModelForCausalLM.from_pretrained`` (and vLLM) load with no PEFT. A full fine-tuning
run's actor directory is a Hugging Face directory already: it is copied through the same
load and save. The command joins the ``m2flow`` CLI as an ``m2flow.commands`` entry point
(:func:`register`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import typer

#: the tokenizer's files of a checkpoint directory (``save_pretrained``'s), copied as they are
TOKENIZER_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "vocab*",
    "merges.txt",
    "chat_template*",
)


def actor_directory(run_dir: str | Path, step: int | None = None, group: str = "actor") -> Path:
    """The ``group`` directory of the run's newest complete checkpoint (or of ``step``).

    Raises:
        ValueError: no complete checkpoint (or none at ``step``), or no ``group`` in it.
    """
    from m2flow.run.recipe import Checkpoints

    found = dict(Checkpoints(run_dir).complete())
    if not found:
        raise ValueError(f"{run_dir} holds no complete checkpoint (checkpoints/step_N/)")
    if step is None:
        step = max(found)
    elif step not in found:
        raise ValueError(f"{run_dir} has no checkpoint of step {step}: it has {sorted(found)}")
    src = found[step] / group
    if not src.is_dir():
        raise ValueError(f"{found[step]} has no {group}/ directory")
    return src


def export_merged(run_dir: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Write the run's policy (newest checkpoint, or ``step``'s) merged to ``out``.

    Returns:
        ``out``, a Hugging Face directory (config, ``model.safetensors``, tokenizer).

    Raises:
        ValueError: no checkpoint (:func:`actor_directory`); ``out`` exists and is not empty;
            the adapter's base directory is gone.
    """
    import torch
    from transformers import AutoModelForCausalLM

    src = actor_directory(run_dir, step)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty: give a new directory")
    if (src / "adapter_config.json").exists():
        from peft import PeftModel

        base = src / "base"
        if not base.is_dir():
            cfg = json.loads((src / "adapter_config.json").read_text())
            base = Path(cfg.get("base_model_name_or_path") or "")
        if not (base / "config.json").exists():
            raise ValueError(
                f"the adapter in {src} applies to the base model {base}, which is gone: "
                "restore that directory (the run's model.path)"
            )
        model = AutoModelForCausalLM.from_pretrained(
            base, dtype=torch.float32, local_files_only=True
        )
        model = PeftModel.from_pretrained(model, src).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(
            src, dtype=torch.float32, local_files_only=True
        )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for pattern in TOKENIZER_FILES:
        for f in src.glob(pattern):
            shutil.copy2(f, out / f.name)
    return out


def export_merged_command(
    run_dir: str = typer.Argument(..., help="the run's directory (trainer.run_dir)"),
    out: str = typer.Argument(..., help="a new directory for the merged Hugging Face model"),
    step: Optional[int] = typer.Option(
        None, "--step", help="a checkpoint's step (default: the newest)"
    ),
) -> None:
    """Write a run's policy as one Hugging Face directory: a LoRA run's adapter merged into
    its base (AutoModelForCausalLM.from_pretrained and vLLM load it without PEFT)."""
    try:
        path = export_merged(run_dir, out, step)
    except (ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"merged model written to {path}")


def register(app: typer.Typer) -> None:
    """Add the ``export-merged`` command to the ``m2flow`` Typer app."""
    app.command("export-merged")(export_merged_command)
