"""Scoring of responses, shared by the roles: the run's reward function (:mod:`.functions`: a
built-in of :mod:`.builtins`, or your own with veRL's signature, run in a child process by
:mod:`.isolated`) and greedy held-out evaluation (:mod:`.evaluation`). No role: the rollout,
actor (warm start) and reward roles import it."""
