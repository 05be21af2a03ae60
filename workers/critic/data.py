"""PPO batch plumbing: joining a rollout chunk with its scores and reference logprobs (one
producer feeds the three consumers through ``m2flow.Fanout``).

A PPO step sends every rollout chunk to three consumers at once (reward model, reference,
critic); the reward model and the reference put their outputs under the chunk's key
(:func:`chunk_key`), and the critic, which also gets the chunk itself, takes them by that key.
"""

from __future__ import annotations


def chunk_key(batch) -> int:
    """The key of a rollout chunk: the GRPO group id (prompt index) of its first row. Prompt
    ids are unique within a step and chunks hold disjoint prompts, so keys are unique in a
    step."""
    return int(batch["group_index"][0])
