"""Megatron-core actor backend (optional extra ``m2flow[megatron]``, ``megatron-core==0.16.1``).

- :mod:`.shims`: the CPU/gloo patches megatron-core needs without CUDA, one comment each.
- :mod:`.arch`: which Hugging Face configs map exactly (Qwen2, Llama, Mistral) and the refusals.
- :mod:`.model`: a Megatron ``GPTModel`` equivalent to such a model, parallel state, logprobs.
- :mod:`.convert`: Hugging Face <-> Megatron checkpoint layout (TP shards split / gathered).
- :mod:`.engine`: what ``ActorWorker(engine="megatron")`` runs (process groups, GRPO step,
  weights gathered to / scattered from Hugging Face layout).

Nothing here imports ``megatron`` at package import time; see docs/results/megatron.md.
"""
