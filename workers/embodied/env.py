"""Environment worker: vectorised Gymnasium simulators on CPU, stepped by a remote policy.

Each rank runs ``num_envs`` copies of an environment in one ``gymnasium.vector.SyncVectorEnv``
with same-step autoreset (a finished copy returns its next episode's first observation at
once, so every step of a trajectory has a fresh action). A rollout is a loop of channel round
trips: observations to the policy group, actions back under this rank's key. That loop is the
env -> policy -> env cycle of the workflow graph (RLinf section 2.1 and Figure 1, embodied RL).

When the plan splits that cycle across devices in sub-batches (``m2flow.scheduler.plan.cycle``),
the rank's call granularity (:meth:`~m2flow.Worker.chunk_size`, items = simulators) splits its
simulators into sub-batches of that many: while the policy computes the actions of one
sub-batch, this rank steps another (RLinf section 5.1.2, embodied pipelining). Each
simulator's steps are the same as when stepped together (same-step autoreset, per simulator).
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch

from m2flow import Channel, Worker, group_method

from ..checkpoint import from_plain, load_state, save_state, to_plain
from ..llm.placement import set_torch_threads
from .config import EnvOptions
from .env_state import restore_vector_env, vector_env_state


class EnvWorker(Worker):
    """``options.num_envs`` simulators of ``options.id`` per rank.

    Args:
        options: the workflow's ``env`` section (:class:`~.config.EnvOptions`): ``id``, a
            registered Gymnasium id with a flat ``Box`` observation space and a ``Discrete``
            action space (``CartPole-v1``, ``Acrobot-v1``, ``MountainCar-v0``); ``num_envs``,
            simulators on this rank (one vectorised env); ``threads``, torch threads (the env
            itself is numpy on one thread).
        seed: reset seed; copy ``i`` of rank ``r`` starts from ``seed + r * num_envs + i``.

    Raises:
        ValueError: an environment whose spaces the MLP policy cannot handle, or whose state
            a checkpoint cannot hold as plain values (:func:`.env_state.vector_env_state`).
    """

    def __init__(self, options: EnvOptions, seed: int = 0) -> None:
        import gymnasium as gym
        from gymnasium.vector import AutoresetMode

        self.options = options
        env_id, num_envs = options.id, options.num_envs
        set_torch_threads(self, options.threads)
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
        self.num_envs = num_envs
        obs, _ = self.envs.reset(seed=seed + self.rank * num_envs)
        self.obs = torch.as_tensor(obs, dtype=torch.float32)
        self.ep_return = np.zeros(num_envs)
        self.ep_length = np.zeros(num_envs, dtype=np.int64)
        self.recent: deque[float] = deque(maxlen=100)  # returns of the last 100 episodes
        vector_env_state(self.envs)  # an env no checkpoint can hold fails here, not at a save

    @group_method
    def save_checkpoint(self, path: str) -> str:
        """The simulators mid-episode (the values of the vector env, its wrappers and envs,
        RNGs included: :func:`.env_state.vector_env_state`), the current observations and the
        episode statistics under ``path``, as tensors and plain values."""
        return save_state(
            path,
            self.rank,
            {
                "envs": vector_env_state(self.envs),
                "obs": self.obs,
                "ep_return": to_plain(self.ep_return),
                "ep_length": to_plain(self.ep_length),
                "recent": list(self.recent),
            },
        )

    @group_method
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote into this rank's env, built from the
        config as on a fresh start.

        Raises:
            ValueError: the checkpoint's env is another (``env.id``/``env.num_envs`` changed).
            StateFileError: a damaged state file, or one holding other objects (not loaded).
        """
        state = load_state(path, self.rank)
        restore_vector_env(self.envs, state["envs"])
        self.obs = state["obs"]
        self.ep_return = from_plain(state["ep_return"])
        self.ep_length = from_plain(state["ep_length"])
        self.recent = deque(state["recent"], maxlen=100)

    @group_method(collect="rank0")
    def spec(self) -> dict:
        """``{"obs_dim", "n_actions"}`` of the environment."""
        return {"obs_dim": self.obs_dim, "n_actions": self.n_actions}

    @group_method
    def rollout(self, obs: Channel, actions: Channel, out: Channel, steps: int) -> dict:
        """Step every simulator ``steps`` times with the policy's actions, then put the
        trajectory into ``out``.

        Each step puts ``{"rank", "obs": [N, obs_dim]}`` into ``obs`` and takes the answer
        ``{"action", "logprob", "value"}`` (each ``[N]``) from ``actions`` under this rank's
        key; one more round trip after the last step gives the bootstrap value. With a plan
        granularity ``g < N`` (simulators per sub-batch), sub-batch ``s`` (simulators
        ``s*g .. s*g+g-1``) goes round on its own: items ``{"rank", "sub": s, "obs"}``,
        answers under key ``(rank, s)``, and the sub-batch is stepped as soon as its answer is
        in. The trajectory is ``{"obs": [T, N, obs_dim], "actions", "logprobs", "values",
        "rewards", "dones": [T, N], "last_value": [N]}`` (``dones``: the episode ended with
        that step, by termination or truncation), put with weight ``T * N``.

        Returns:
            ``env_steps``, ``episodes`` finished, ``return_sum`` and ``length_sum`` over them,
            ``recent_return`` (mean of the last 100 episodes of this rank, NaN before the
            first), ``env_s`` (seconds inside the simulators' steps), ``sub_batches``.
        """
        n = len(self.obs)
        size = min(self.chunk_size(default=n), n)
        parts = [slice(a, min(a + size, n)) for a in range(0, n, size)]
        keys = ("obs", "actions", "logprobs", "values", "rewards", "dones")
        traj: dict[str, list] = {k: [] for k in keys}
        finished: list[tuple[float, int]] = []
        env_s = 0.0
        last: list = [None] * len(parts)
        # Each sub-batch's observations as its own tensor, replaced (never written in place:
        # a put may still hold it) after each step.
        cur = [self.obs] if len(parts) == 1 else [self.obs[p].clone() for p in parts]

        def send(s: int) -> None:
            if len(parts) == 1:
                obs.put({"rank": self.rank, "obs": cur[0]})
            else:
                obs.put({"rank": self.rank, "sub": s, "obs": cur[s]})

        for s in range(len(parts)):
            send(s)
        for t in range(steps + 1):
            row: dict[str, list] = {k: [] for k in keys}
            for s, part in enumerate(parts):
                key = self.rank if len(parts) == 1 else (self.rank, s)
                answer = last[s] = actions.get(key=key)
                if t == steps:
                    continue
                t0 = time.perf_counter()
                nxt, reward, term, trunc = self._step(part, answer["action"].numpy(), n)
                env_s += time.perf_counter() - t0
                done = np.logical_or(term, trunc)
                ret, length = self.ep_return[part], self.ep_length[part]
                ret += reward
                length += 1
                for i in np.flatnonzero(done):
                    finished.append((float(ret[i]), int(length[i])))
                    self.recent.append(float(ret[i]))
                ret[done], length[done] = 0.0, 0
                for k, v in zip(keys, (cur[s], answer["action"], answer["logprob"],
                                       answer["value"], reward, done)):  # fmt: skip
                    row[k].append(torch.as_tensor(v))
                cur[s] = torch.as_tensor(nxt, dtype=torch.float32)
                send(s)
            if t < steps:
                for k in keys:
                    traj[k].append(torch.cat(row[k]) if len(parts) > 1 else row[k][0])
        self.obs = cur[0] if len(parts) == 1 else torch.cat(cur)
        item = {k: torch.stack(v) for k, v in traj.items()}
        item["rewards"], item["dones"] = item["rewards"].float(), item["dones"].float()
        item["last_value"] = torch.cat([a["value"] for a in last])
        item["rank"] = self.rank
        out.put(item, weight=steps * n)
        return {
            "env_steps": steps * n,
            "episodes": len(finished),
            "return_sum": sum(r for r, _ in finished),
            "length_sum": sum(m for _, m in finished),
            "recent_return": float(np.mean(self.recent)) if self.recent else float("nan"),
            "env_s": env_s,
            "sub_batches": len(parts),
        }

    def _step(self, part: slice, action: np.ndarray, n: int):
        """Step the simulators of ``part`` (all ``n``: the vector env itself, else each one
        as the vector env does with same-step autoreset); ``(obs, reward, term, trunc)``."""
        if part.stop - part.start == n:
            nxt, reward, term, trunc, _ = self.envs.step(action)
            return nxt, reward, term, trunc
        out = []
        for env, a in zip(self.envs.envs[part], action):
            o, r, te, tr, _ = env.step(a)
            if te or tr:
                o, _ = env.reset()
            out.append((o, r, te, tr))
        o, r, te, tr = zip(*out)
        return np.stack(o), np.array(r, dtype=np.float64), np.array(te), np.array(tr)

    @group_method(collect="rank0")
    def share_items(self) -> int:
        """Simulators on this rank: the items a plan's sub-batches split (``m2flow profile``
        reads it to cost the env <-> policy cycle split, :mod:`m2flow.run.profiler`)."""
        return self.num_envs
