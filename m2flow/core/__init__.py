"""The runtime core: workers and their groups, channels, mailboxes, device locks and residency,
weight synchronisation, the cluster and its placement (RLinf sections 3.1-3.3 and 3.5).

It sits on the process context (:mod:`m2flow._context`, :mod:`m2flow._env`) and the pure
policies of :mod:`m2flow.scheduler`; it imports nothing of the run layer (:mod:`m2flow.run`)
nor of the workers above it (import contract ``layers`` in pyproject.toml).
"""
