"""LoRA against full fine-tuning on one pretrained directory: the actor's memory, step time and
bytes synced per step.

A small Qwen2-shaped model (``--hidden``/``--layers``; a few M parameters, the char tokenizer)
is built from a config and saved with ``save_pretrained`` into a temporary directory; both
modes load it as ``model.path``. Each measurement is one child process (so its peak RSS is its
own) that builds the torch engine (``actor.lora.rank=0`` or ``--rank``), takes ``--warmup``
GRPO updates, then ``--steps`` timed ones on one fixed batch (``--samples`` responses of
``--response`` tokens), and reports:

- ``step_s``: median seconds of one update (forward, backward, AdamW step);
- ``peak_rss_mib``: the child's peak resident memory (``ru_maxrss``: the interpreter, torch
  and the model included, on CPU, where torch has no allocator statistics);
- ``state_mib``: parameters + gradients + AdamW state, counted tensor by tensor (what a device
  would hold for training, activations aside);
- ``sync_bytes``: the weight-sync payload of one step (full: every weight; LoRA: the adapter
  alone, :meth:`~m2flow.workers.engines.torch_engine.TorchEngine.weight_payload`).

Repeats are interleaved (full and LoRA once per round, the first alternating); the table gives
medians and the spread (min-max over the rounds).

    python benchmarks/lora.py [--repeats 3] [--rank 8] [--out benchmarks/results/lora.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build_directory(path: Path, hidden: int, layers: int) -> int:
    """Save a random-weight Qwen2 of the given shape with the char tokenizer; its size."""
    import torch
    from m2flow.workers.llm import build_char_tokenizer
    from transformers import AutoModelForCausalLM, Qwen2Config

    tok = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def child(args) -> dict:
    """One measurement (module docstring); prints its JSON record."""
    import torch
    from m2flow.workers.algos.losses import make_loss
    from m2flow.workers.engines.lora import payload_bytes
    from m2flow.workers.engines.torch_engine import TorchEngine
    from m2flow.workers.engines.update import StreamedStep
    from m2flow.workers.llm import build_char_tokenizer

    torch.set_num_threads(args.threads)
    tok = build_char_tokenizer()
    lora = {"rank": args.rank} if args.mode == "lora" else None
    engine = TorchEngine({"path": args.dir}, tok, device=torch.device("cpu"),
                         optim={"lr": 1e-4, "temperature": 1.0}, lora=lora)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    n, p, r = args.samples, 16, args.response
    vocab = len(tok)
    batch = {
        "prompt_ids": torch.randint(4, vocab, (n, p), generator=g),
        "prompt_mask": torch.ones(n, p, dtype=torch.long),
        "response_ids": torch.randint(4, vocab, (n, r), generator=g),
        "response_mask": torch.ones(n, r, dtype=torch.long),
        "advantages": torch.randn(n, generator=g),
    }
    batch["old_logprobs"] = engine.infer(batch)
    loss = make_loss("grpo", "policy")
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        step = StreamedStep(engine, loss, None)
        step.add(batch)
        step.finish()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    params = [t for t in engine.model.parameters()]
    grads = [t for t in params if t.requires_grad]  # a gradient each during the step
    opt = [v for s in engine.optimizer.state.values() for v in s.values() if v.dim() > 0]
    state = sum(t.numel() * t.element_size() for t in [*params, *grads, *opt])
    payload = engine.weight_payload(base=False)
    return {
        "mode": args.mode,
        "step_s": statistics.median(times),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "state_mib": state / 2**20,
        "sync_bytes": payload_bytes(payload),
        "trained_params": sum(t.numel() for t in grads),
    }


def run_child(args, mode: str, directory: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--dir", str(directory),
           "--rank", str(args.rank), "--samples", str(args.samples), "--response",
           str(args.response), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=["full", "lora"], help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--samples", type=int, default=16, help="responses per update")
    ap.add_argument("--response", type=int, default=32, help="tokens per response")
    ap.add_argument("--steps", type=int, default=5, help="timed updates per measurement")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/lora.json")
    args = ap.parse_args()
    if args.child:
        args.mode = args.child
        print(json.dumps(child(args)))
        return
    with tempfile.TemporaryDirectory(prefix="m2flow-lora-") as tmp:
        directory = Path(tmp) / "model"
        n_params = build_directory(directory, args.hidden, args.layers)
        runs: dict[str, list[dict]] = {"full": [], "lora": []}
        for i in range(args.repeats):
            for mode in ("full", "lora") if i % 2 == 0 else ("lora", "full"):
                runs[mode].append(run_child(args, mode, directory))
    keys = ("step_s", "peak_rss_mib", "state_mib", "sync_bytes")
    table = {m: {k: summary([r[k] for r in rs]) for k in keys} | {
        "trained_params": rs[0]["trained_params"]} for m, rs in runs.items()}  # fmt: skip
    print(f"model: Qwen2-shaped, {n_params / 1e6:.2f} M parameters (hidden {args.hidden}, "
          f"{args.layers} layers); LoRA rank {args.rank}, all linear layers; "
          f"{args.samples} responses x {args.response} tokens per update; "
          f"{args.repeats} interleaved rounds")  # fmt: skip
    print(f"{'':6} {'step s':>22} {'peak RSS MiB':>22} {'train state MiB':>22} "
          f"{'sync bytes/step':>16} {'trained params':>15}")  # fmt: skip
    for m, row in table.items():
        cells = [f"{row[k]['median']:.3f} ({row[k]['min']:.3f}-{row[k]['max']:.3f})"
                 for k in ("step_s", "peak_rss_mib", "state_mib")]  # fmt: skip
        print(f"{m:6} {cells[0]:>22} {cells[1]:>22} {cells[2]:>22} "
              f"{row['sync_bytes']['median']:>16,.0f} {row['trained_params']:>15,}")  # fmt: skip
    ratio = table["full"]["sync_bytes"]["median"] / table["lora"]["sync_bytes"]["median"]
    print(f"sync bytes per step: LoRA sends 1/{ratio:.0f} of full fine-tuning's")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"parameters": n_params, "args": {k: v for k, v in vars(args).items()
            if k not in ("child", "dir", "mode")}, "python": platform.python_version(),
            "machine": platform.machine()}  # fmt: skip
    out.write_text(json.dumps({"meta": meta, "table": table, "runs": runs}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
