"""Prompts for the LLM workflows: one item type for every source, one sampler.

- :mod:`.item`: :class:`PromptItem` (token ids made once, ``data_source``, ``ground_truth``,
  ``extra_info``, ``index``), the prompt limit, and the step's prompt items for the rollout.
- :mod:`.files`: your own data: JSONL/JSON/Parquet files in veRL's columns, read with
  Hugging Face ``datasets`` (``data.train_files``, ``data.val_files``).
- :mod:`.reasoning_gym`: reasoning-gym's procedural tasks as prompt items (the default).
- :mod:`.sampler`: seeded per-epoch shuffling; its position is part of a checkpoint.
- :mod:`.config`: the ``data`` config section and its checks; :mod:`.splits`: a run's splits.
"""
