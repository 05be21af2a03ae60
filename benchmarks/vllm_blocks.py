"""What block-wise generation costs on vLLM CPU: the spot pool's path (each block a new request
continuing prompt + partial response, :meth:`VllmEngine.step`) against one-shot generation of
the same responses (:meth:`VllmEngine.generate`), in response tokens per second.

Setup: one in-process vLLM CPU engine (fp32, prefix caching on) on a randomly initialised Qwen2
of the repository's shape (``--hidden``/``--layers``, head_dim 64), ``--prompts`` chain-sum
prompts x ``--samples`` responses of exactly ``--tokens`` tokens (``min_new_tokens`` = the cap,
so every arm generates the same tokens' worth of work). Arms: ``oneshot`` (``generate``) and
``block=K`` for each ``--blocks`` size (``K >= tokens`` is one block: ``step``'s overhead
alone). Arms are interleaved round by round (``--repeats``); medians and half-ranges are
reported, with vLLM's prefix-cache hit rate per arm (cached prompt tokens / prompt tokens
queried: how much of each continuation's prefill the cache served). ``--kv-block`` sets vLLM's
KV block size (CPU default 128; multiples of 32): a continuation reuses only whole cached
blocks. Writes ``benchmarks/results/vllm_blocks.json``.

    python benchmarks/vllm_blocks.py [--repeats 5] [--tokens 256] [--blocks 8 16 32 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from m2flow.workers.data.item import prompt_items
from m2flow.workers.data.reasoning_gym import task_items
from m2flow.workers.data.sampler import PromptSampler
from m2flow.workers.llm import ModelConfig, build_char_tokenizer, build_model
from m2flow.workers.rollout.exact import GenRequest
from m2flow.workers.rollout.vllm_engine import VllmEngine
from m2flow.workers.tasks import TaskDataset

ROOT = Path(__file__).resolve().parent.parent
ALPHABET = "0123456789+-="


def _cache_counters(engine: VllmEngine) -> tuple[float, float]:
    """(prefix-cache queries, hits) in tokens, from vLLM's metrics (needs log stats on)."""
    q = h = 0.0
    for m in engine.llm.get_metrics():
        if m.name == "vllm:prefix_cache_queries":
            q += m.value
        elif m.name == "vllm:prefix_cache_hits":
            h += m.value
    return q, h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--blocks", type=int, nargs="+", default=[8, 16, 32, 256])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-block", type=int, default=0, help="vLLM KV block size (0: default)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm_blocks.json"))
    a = ap.parse_args()
    os.environ.setdefault("VLLM_CACHE_ROOT", "/tmp/m2flow-vllm-cache")

    tok = build_char_tokenizer(ALPHABET)
    cfg = ModelConfig(hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                      num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64,
                      num_key_value_heads=1, max_position_embeddings=a.tokens + 64)  # fmt: skip
    model = build_model(cfg, tok, seed=0).eval()
    kwargs = {"disable_log_stats": False}  # the prefix-cache counters
    if a.kv_block:
        kwargs["block_size"] = a.kv_block
    engine = VllmEngine(model, tok, temperature=1.0, seed=0, min_new_tokens=a.tokens,
                        max_num_seqs=a.prompts * a.samples, llm_kwargs=kwargs)  # fmt: skip
    train = TaskDataset("chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 1,
                                      "max_digits": 2}, seed=1, size=256)  # fmt: skip
    items = prompt_items(task_items(train, tok), PromptSampler(len(train)).take(a.prompts), 0)
    prompts = [it["prompt_ids"] for it in items]
    n_tokens = a.prompts * a.samples * a.tokens

    def oneshot() -> None:
        gen = engine.generate(prompts, a.samples, a.tokens)
        assert int(gen["response_mask"].sum()) == n_tokens

    def blocks(k: int):
        def run() -> None:
            reqs = [GenRequest(f"{p}:{j}", ids, (0, p, j), a.tokens)
                    for p, ids in enumerate(prompts) for j in range(a.samples)]  # fmt: skip
            while not all(r.done for r in reqs):
                engine.step(reqs, k, version=0)
            assert sum(len(r.tokens) for r in reqs) == n_tokens

        return run

    arms = {"oneshot": oneshot, **{f"block={k}": blocks(k) for k in a.blocks}}
    for run in arms.values():  # warm-up: first-call costs out of the measurement
        run()
    rows: dict[str, list[dict]] = {name: [] for name in arms}
    for r in range(a.repeats):
        for name, run in arms.items():
            engine.llm.reset_prefix_cache()  # each arm starts from an empty cache
            q0, h0 = _cache_counters(engine)
            t0 = time.perf_counter()
            run()
            dt = time.perf_counter() - t0
            q1, h1 = _cache_counters(engine)
            rows[name].append({"s": dt, "tok_s": n_tokens / dt,
                               "cache_hit": (h1 - h0) / max(q1 - q0, 1)})  # fmt: skip
        print(f"round {r + 1}/{a.repeats}: " + ", ".join(
            f"{n} {rows[n][-1]['tok_s']:.0f}" for n in arms), flush=True)  # fmt: skip
    summary = {}
    print(f"\n{'arm':10} {'tok/s':>8} {'+-':>6} {'vs oneshot':>10} {'cache hit':>9}")
    base = statistics.median(x["tok_s"] for x in rows["oneshot"])
    for name in arms:
        v = [x["tok_s"] for x in rows[name]]
        med, half = statistics.median(v), (max(v) - min(v)) / 2
        hit = statistics.median(x["cache_hit"] for x in rows[name])
        summary[name] = {"median_tok_s": med, "half_range_tok_s": half, "vs_oneshot": med / base,
                         "prefix_cache_hit": hit}  # fmt: skip
        print(f"{name:10} {med:8.0f} {half:6.0f} {med / base:10.2f} {hit:9.2f}")
    load = os.getloadavg()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(
        {"args": vars(a), "params": sum(p.numel() for p in model.parameters()),
         "torch_threads": torch.get_num_threads(), "loadavg": load, "summary": summary,
         "rows": rows}, indent=2) + "\n")  # fmt: skip
    print(f"load average {load[0]:.1f}; wrote {a.out}")
    engine.close()


if __name__ == "__main__":
    main()
