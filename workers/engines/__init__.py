"""Engines: how a model is trained or sampled, apart from the role that uses it.

A role (``actor``, ``critic``, ``rollout``, ...) composes an engine with an algorithm
(:mod:`~m2flow.workers.algos`); engines import no role. Each kind is chosen by name from a
registry (:mod:`.registry`), so a new backend is a new module that registers itself.
"""
