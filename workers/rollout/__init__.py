"""Rollout: the rollout role (:mod:`.worker`), its generation engines (Hugging Face ``generate``
in :mod:`.generation`, :mod:`.exact`, :mod:`.vllm_engine`, :mod:`.emulated`), greedy held-out
evaluation (:mod:`.evaluation`), and the spot rollout pool that the role runs a step through
with ``rollout.spot.enabled`` (:mod:`.spot`)."""
