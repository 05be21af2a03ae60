"""Critic: a value head on a causal LM, GAE and the clipped value loss (RLHF-style PPO)."""
