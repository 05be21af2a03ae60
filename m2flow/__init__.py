"""m2flow: a Ray-native runtime for RL post-training.

Exports are lazy so that ``import m2flow.scheduler`` pulls in neither Ray nor torch.
"""

from importlib import import_module

from ._env import apply_ray_env_defaults

# Ray reads its logging switches (RAY_DEDUP_LOGS, ...) when it is imported: set them first.
apply_ray_env_defaults()

__version__ = "0.1.0"

_EXPORTS = {
    "Cluster": "m2flow.core.cluster",
    "Device": "m2flow.core.cluster",
    "Worker": "m2flow.core.worker",
    "group_method": "m2flow.core.methods",
    "no_device_lock": "m2flow.core.methods",
    "control_method": "m2flow.core.methods",
    "current_worker": "m2flow.core.worker",
    "WorkerGroup": "m2flow.core.group",
    "GroupCall": "m2flow.core.group",
    "WorkerError": "m2flow.core.group",
    "Channel": "m2flow.core.channel",
    "Fanout": "m2flow.core.channel",
    "StreamAborted": "m2flow.core.channel",
    "WorkerDied": "m2flow.core.liveness",
    "sync_weights": "m2flow.core.weights",
    "run_workflow": "m2flow.run.workflow",
    "workflow_graph": "m2flow.run.trace",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'm2flow' has no attribute {name!r}")
