"""Rank body of the Megatron-vs-HF parity check (used by tests/test_megatron.py).

The parent process builds the HF model and a batch, saves them (``case.pt``), and spawns
``tp * pp * dp`` processes that each run :func:`parity_rank`: join a gloo group (file
rendezvous, a timeout so nothing hangs), build this rank's Megatron model (its TP shard of its
pipeline stage), load its shard of the HF weights, compute per-token logprobs and the GRPO loss
on its share of the batch, backpropagate, take one plain ``torch.optim.AdamW`` step, and save
logprobs, loss, gradients and the stepped shard (``rank{r}.pt``). The parent gathers the shards
back to HF layout and compares with the same step on the HF model.

- PP > 1 runs Megatron's own pipeline schedule (``get_forward_backward_func``: 1F1B without
  interleaving) with p2p over gloo; with tied embeddings the first and last stages' copies of
  the embedding get their gradients summed over the embedding group (what Megatron's
  ``finalize_model_grads`` does for a DDP-wrapped model).
- DP is plain: every DP rank takes a contiguous slice of the responses, the loss is normalised
  by the global token count, and gradients are summed over the DP group with one ``all_reduce``
  per parameter (no Megatron DDP wrapper, no distributed optimizer).

:func:`engine_rank` runs the actor's own engine instead (:class:`~.engine.MegatronEngine`:
mini- and micro-batches, the pipeline schedule with padded micro-batches, the reference shard
for KL, offload/onload) on the same kind of case, and saves its metrics and the weights it
gathers to HF layout, for comparison with the torch engine (``TorchEngine``).
"""

from __future__ import annotations

import datetime
import os
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist


def join_world(rank: int, world: int, workdir: str | os.PathLike) -> Path:
    """A spawned rank's set-up: quiet warnings, one torch thread, and the gloo world of
    :func:`spawn_parity` (file rendezvous in ``workdir``, 60 s timeout). Returns ``workdir``."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    workdir = Path(workdir)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{workdir / 'rendezvous'}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    return workdir


def parity_rank(rank: int, world: int, workdir: str, tp: int, dp: int, pp: int = 1) -> None:
    """One rank of the parity run; writes ``workdir/rank{rank}.pt``."""
    workdir = join_world(rank, world, workdir)
    try:
        _run(rank, workdir, tp, dp, pp)
    finally:
        dist.destroy_process_group()


def _run(rank: int, workdir: Path, tp: int, dp: int, pp: int) -> None:
    from megatron.core import parallel_state as ps

    from ...algos.grpo import grpo_loss
    from .convert import hf_to_megatron, load_megatron_state, megatron_state
    from .model import build_gpt_model, init_parallel, logprobs_from_rolled_logits, rolled_inputs

    case = torch.load(workdir / "case.pt", weights_only=False)
    init_parallel(tp=tp, pp=pp, dp=dp)
    tp_rank, dp_rank, pp_rank = (
        ps.get_tensor_model_parallel_rank(),
        ps.get_data_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
    )
    cfg = case["hf_config"]
    per_stage = cfg.num_hidden_layers // pp
    model = build_gpt_model(cfg)
    shape = model.m2flow_shape
    load_megatron_state(
        model,
        hf_to_megatron(
            case["hf_state"],
            shape,
            tp_rank=tp_rank,
            tp_size=tp,
            layer_offset=pp_rank * per_stage,
            num_layers=per_stage,
            pre_process=model.pre_process,
            post_process=model.post_process,
        ),
    )
    model.train()
    batch = case["batch"]
    rows = torch.chunk(torch.arange(len(batch["response_ids"])), dp)[dp_rank]
    b = {k: v[rows] for k, v in batch.items()}
    tokens, position_ids, causal, back = rolled_inputs(
        b["prompt_ids"], b["prompt_mask"], b["response_ids"]
    )
    out: dict[str, torch.Tensor] = {}

    def last_stage(logits):
        logprobs = logprobs_from_rolled_logits(
            logits,
            back,
            b["prompt_ids"].shape[1],
            b["response_ids"],
            b["response_mask"],
            shape.vocab_size,
        )
        loss, _ = grpo_loss(
            logprobs,
            b["old_logprobs"],
            b["advantages"],
            b["response_mask"],
            num_tokens=float(batch["response_mask"].sum()),  # global tokens: DP shares sum up
        )
        out["logprobs"], out["loss"] = logprobs.detach(), loss.detach()
        return loss, {"loss": loss.detach()}

    opt = torch.optim.AdamW(model.parameters(), **case["adamw"])
    opt.zero_grad()
    if pp == 1:
        last_stage(model(tokens, position_ids, attention_mask=causal))[0].backward()
    else:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, stage_model):
            logits = stage_model(tokens, position_ids, attention_mask=causal)
            return logits, last_stage

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([None]),
            model=[model],
            num_microbatches=1,
            seq_length=tokens.shape[1],
            micro_batch_size=tokens.shape[0],
            forward_only=False,
        )
        if shape.tie_word_embeddings and ps.is_rank_in_embedding_group():
            shared = model.shared_embedding_or_output_weight()
            dist.all_reduce(shared.grad, group=ps.get_embedding_group())
    if dp > 1:
        group = ps.get_data_parallel_group()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    torch.save(
        {
            "tp_rank": tp_rank,
            "dp_rank": dp_rank,
            "pp_rank": pp_rank,
            "layers": per_stage,
            "rows": rows,
            **out,  # logprobs and loss: last pipeline stage only
            "grads": grads,
            "state": megatron_state(model),
        },
        workdir / f"rank{rank}.pt",
    )
    ps.destroy_model_parallel()


def engine_rank(rank: int, world: int, workdir: str, tp: int, dp: int, pp: int = 1) -> None:
    """One rank of a :class:`~.engine.MegatronEngine` run on ``workdir/case.pt``
    (``hf_config``, ``hf_state``, ``batch``, ``trainer``: the mechanics' and the loss's
    settings, ``steps``: a list of ``(mini_batch_size, micro_batch_size)``, one GRPO update
    each (:func:`~..update.minibatch_update`, behaviour and reference logprobs computed first),
    with an offload/onload before each); rank 0 writes ``engine.pt`` (``metrics`` per call,
    ``hf``: the gathered weights)."""
    workdir = join_world(rank, world, workdir)
    from ...algos.losses import make_loss
    from ..update import minibatch_update
    from .engine import MegatronEngine

    case = torch.load(workdir / "case.pt", weights_only=False)
    engine = MegatronEngine(
        case["hf_config"],
        case["hf_state"] if rank == 0 else None,
        rank,
        world,
        {},
        torch.device("cpu"),
        tp,
        case["trainer"],
        pipeline_parallel=pp,
    )
    try:
        if "policy_state" in case:  # the policy moved away from the reference (KL != 0)
            engine.load_hf(case["policy_state"] if rank == 0 else None)
        metrics = []
        keys = ("clip_eps_low", "clip_eps_high", "kl_coef")  # the loss's part of "trainer"
        loss = make_loss("grpo", "policy", **{k: case["trainer"][k] for k in keys
                                              if k in case["trainer"]})  # fmt: skip
        for mini, micro in case["steps"]:
            engine.offload()
            engine.onload()
            data = dict(case["batch"])  # behaviour and reference logprobs before the update
            if "old_logprobs" not in data:
                data["old_logprobs"] = engine.infer(data, None, micro)
            if engine.ref_model is not None and "ref_logprobs" not in data:
                data["ref_logprobs"] = engine.infer(data, None, micro, reference=True)
            metrics.append(minibatch_update(engine, data, loss, mini, micro))
        hf = engine.gather_hf()
        if rank == 0:
            torch.save({"metrics": metrics, "hf": hf}, workdir / "engine.pt")
    finally:
        engine.shutdown()


def spawn_parity(
    workdir: str | os.PathLike,
    tp: int,
    dp: int = 1,
    pp: int = 1,
    timeout_s: float = 120,
    target=None,
) -> None:
    """Run ``target`` (default :func:`parity_rank`; or :func:`engine_rank`, or the critic's
    :func:`~m2flow.workers.engines.megatron.critic_parity.critic_parity_rank`; same arguments) on
    ``tp * pp * dp`` spawned processes (raises if one fails or the whole run exceeds
    ``timeout_s``; stragglers are terminated)."""
    import torch.multiprocessing as mp

    world = tp * pp * dp
    ctx = mp.start_processes(
        target or parity_rank,
        args=(world, str(Path(workdir).resolve()), tp, dp, pp),  # file:// needs an absolute path
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"Megatron parity run exceeded {timeout_s}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
