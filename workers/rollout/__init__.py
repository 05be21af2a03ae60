"""Rollout (generation) code."""
