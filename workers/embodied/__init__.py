"""Embodied RL: vectorised Gymnasium simulators, a neural policy serving actions, a PPO actor."""
