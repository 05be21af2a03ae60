"""Spot rollout pool (RLBoost): a rollout manager, spot instances on preemptible nodes, and the
reserved rollout ranks seeding each step. Policies live in :mod:`m2flow.scheduler.spot`."""
