"""Megatron-core actor backend (optional extra ``m2flow[megatron]``, ``megatron-core==0.16.1``).

- :mod:`.shims`: the CPU/gloo patches megatron-core needs without CUDA, one comment each.
- :mod:`.model`: a Megatron ``GPTModel`` shaped like our Qwen2, parallel state, logprobs.
- :mod:`.convert`: Hugging Face <-> Megatron checkpoint layout (TP shards split / gathered).
- :mod:`.engine`: what ``ActorWorker(engine="megatron")`` runs (process groups, GRPO step,
  weights gathered to / scattered from Hugging Face layout).

Nothing here imports ``megatron`` at package import time; see docs/megatron.md.
"""
