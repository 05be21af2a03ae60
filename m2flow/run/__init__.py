"""The run layer: what turns a workflow program into a run on the runtime core.

The ``m2flow`` command line (``run``, ``plan``, ``timeline``), loading and configuring workflow
programs, profiling and planning them (RLinf section 3.4), the run session around a runner, the
run directory (lock, metric sinks, console log) and what every runner shares (:mod:`.recipe`).
It imports the runtime core (:mod:`m2flow.core`), never the reverse.
"""
