"""m2flow: a Ray-native runtime for RL post-training.

Exports are lazy so that ``import m2flow.scheduler`` pulls in neither Ray nor torch.
"""

from importlib import import_module

from ._env import apply_ray_env_defaults

# Ray reads its logging switches (RAY_DEDUP_LOGS, ...) when it is imported: set them first.
apply_ray_env_defaults()

__version__ = "0.1.0"

_EXPORTS = {
    "Cluster": "m2flow.cluster",
    "Device": "m2flow.cluster",
    "Worker": "m2flow.worker",
    "group_method": "m2flow.methods",
    "no_device_lock": "m2flow.methods",
    "control_method": "m2flow.methods",
    "current_worker": "m2flow.worker",
    "WorkerGroup": "m2flow.group",
    "GroupCall": "m2flow.group",
    "WorkerError": "m2flow.group",
    "Channel": "m2flow.channel",
    "Fanout": "m2flow.channel",
    "StreamAborted": "m2flow.channel",
    "WorkerDied": "m2flow.liveness",
    "sync_weights": "m2flow.weights",
    "run_workflow": "m2flow.workflow",
    "workflow_graph": "m2flow.trace",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'm2flow' has no attribute {name!r}")
