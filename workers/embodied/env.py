"""Environment worker: vectorised Gymnasium simulators on CPU, stepped by a remote policy.

Each rank runs ``num_envs`` copies of an environment in one ``gymnasium.vector.SyncVectorEnv``
with same-step autoreset (a finished copy returns its next episode's first observation at
once, so every step of a trajectory has a fresh action). A rollout is a loop of channel round
trips: observations to the policy group, actions back under this rank's key. That loop is the
env -> policy -> env cycle of the workflow graph (RLinf section 3, embodied RL).
"""

from __future__ import annotations

import pickle
import time
from collections import deque

import numpy as np
import torch
from ray import cloudpickle

from m2flow import Channel, Worker

from ..checkpoint import load_state, save_state


class EnvWorker(Worker):
    """``num_envs`` simulators of ``env_id`` per rank.

    Args:
        env_id: a registered Gymnasium id with a flat ``Box`` observation space and a
            ``Discrete`` action space (``CartPole-v1``, ``Acrobot-v1``, ``MountainCar-v0``).
        num_envs: simulators on this rank (one vectorised env).
        seed: reset seed; copy ``i`` of rank ``r`` starts from ``seed + r * num_envs + i``.
        threads: torch threads (the env itself is numpy on one thread).

    Raises:
        ValueError: an environment whose spaces the MLP policy cannot handle.
    """

    def __init__(self, env_id: str, num_envs: int = 16, seed: int = 0, threads: int = 1) -> None:
        import gymnasium as gym
        from gymnasium.vector import AutoresetMode

        torch.set_num_threads(threads or self.num_threads)
        self.envs = gym.make_vec(
            env_id,
            num_envs=num_envs,
            vectorization_mode="sync",
            vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP},
        )
        obs_space, act_space = self.envs.single_observation_space, self.envs.single_action_space
        if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 1:
            raise ValueError(f"{env_id}: observations must be a flat Box, got {obs_space}")
        if not isinstance(act_space, gym.spaces.Discrete):
            raise ValueError(f"{env_id}: actions must be Discrete, got {act_space}")
        self.obs_dim, self.n_actions = int(obs_space.shape[0]), int(act_space.n)
        obs, _ = self.envs.reset(seed=seed + self.rank * num_envs)
        self.obs = torch.as_tensor(obs, dtype=torch.float32)
        self.ep_return = np.zeros(num_envs)
        self.ep_length = np.zeros(num_envs, dtype=np.int64)
        self.recent: deque[float] = deque(maxlen=100)  # returns of the last 100 episodes

    def save_checkpoint(self, path: str) -> str:
        """The simulators mid-episode (the vector env pickled with its RNGs), the current
        observations and the episode statistics under ``path``."""
        return save_state(
            path,
            self.rank,
            {
                # cloudpickle: the vector env keeps its constructors as local functions
                "envs": cloudpickle.dumps(self.envs),
                "obs": self.obs,
                "ep_return": self.ep_return,
                "ep_length": self.ep_length,
                "recent": list(self.recent),
            },
        )

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""
        state = load_state(path, self.rank)
        self.envs.close()
        self.envs, self.obs = pickle.loads(state["envs"]), state["obs"]
        self.ep_return, self.ep_length = state["ep_return"], state["ep_length"]
        self.recent = deque(state["recent"], maxlen=100)

    def spec(self) -> dict:
        """``{"obs_dim", "n_actions"}`` of the environment."""
        return {"obs_dim": self.obs_dim, "n_actions": self.n_actions}

    def rollout(self, obs: Channel, actions: Channel, out: Channel, steps: int) -> dict:
        """Step every simulator ``steps`` times with the policy's actions, then put the
        trajectory into ``out``.

        Each step puts ``{"rank", "obs": [N, obs_dim]}`` into ``obs`` and takes the answer
        ``{"action", "logprob", "value"}`` (each ``[N]``) from ``actions`` under this rank's
        key; one more round trip after the last step gives the bootstrap value. The trajectory
        is ``{"obs": [T, N, obs_dim], "actions", "logprobs", "values", "rewards", "dones":
        [T, N], "last_value": [N]}`` (``dones``: the episode ended with that step, by
        termination or truncation), put with weight ``T * N``.

        Returns:
            ``env_steps``, ``episodes`` finished, ``return_sum`` and ``length_sum`` over them,
            ``recent_return`` (mean of the last 100 episodes of this rank, NaN before the
            first), ``env_s`` (seconds inside ``envs.step``).
        """
        keys = ("obs", "actions", "logprobs", "values", "rewards", "dones")
        traj: dict[str, list] = {k: [] for k in keys}
        finished: list[tuple[float, int]] = []
        env_s = 0.0
        for t in range(steps + 1):
            obs.put({"rank": self.rank, "obs": self.obs})
            answer = actions.get(key=self.rank)
            if t == steps:
                break
            t0 = time.perf_counter()
            nxt, reward, term, trunc, _ = self.envs.step(answer["action"].numpy())
            env_s += time.perf_counter() - t0
            done = np.logical_or(term, trunc)
            self.ep_return += reward
            self.ep_length += 1
            for i in np.flatnonzero(done):
                finished.append((float(self.ep_return[i]), int(self.ep_length[i])))
                self.recent.append(float(self.ep_return[i]))
            self.ep_return[done], self.ep_length[done] = 0.0, 0
            for k, v in zip(keys, (self.obs, answer["action"], answer["logprob"],
                                   answer["value"], reward, done)):  # fmt: skip
                traj[k].append(torch.as_tensor(v))
            self.obs = torch.as_tensor(nxt, dtype=torch.float32)
        item = {k: torch.stack(v) for k, v in traj.items()}
        item["rewards"], item["dones"] = item["rewards"].float(), item["dones"].float()
        item["last_value"] = answer["value"]
        item["rank"] = self.rank
        out.put(item, weight=steps * len(self.obs))
        return {
            "env_steps": steps * len(self.obs),
            "episodes": len(finished),
            "return_sum": sum(r for r, _ in finished),
            "length_sum": sum(n for _, n in finished),
            "recent_return": float(np.mean(self.recent)) if self.recent else float("nan"),
            "env_s": env_s,
        }
