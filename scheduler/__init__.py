"""m2flow.scheduler: pure planning and policy code (numpy/scipy/networkx only; no Ray, no torch).

Mechanisms in ``m2flow`` and ``m2flow.workers`` call these policies with explicit inputs, so
the same code runs live and in trace replay.
"""
