"""Multi-turn, tool-calling rollouts (issue 33): environments, tools, the agent loop that keeps
the sampled tokens (token-in, token-out), and the OpenAI-compatible endpoint.

- :mod:`.env`: the :class:`~.env.Environment` protocol an episode runs against.
- :mod:`.parsers`: tool calls in the model's text, per model family.
- :mod:`.chat`: token-in, token-out: the prompt, the observations' ids, the trajectory and
  its loss mask.
- :mod:`.tools`: :class:`~.tools.ToolEnvironment` from Python functions.
- :mod:`.loop`: the agent loop over a rollout engine.
- :mod:`.openai_server`: ``/v1/chat/completions`` and ``/v1/completions`` served by the
  rollout group, every call's tokens recorded.
- :mod:`.openai_calls`: the endpoint's batching, call records and their merge into
  trajectories.
"""
