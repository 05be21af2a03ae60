"""Ray names of the spot pool's actors: what the rollout manager registers under and the spot
instances (and tests) look it up by, in a module of its own so that neither imports the other
for it."""

#: the run's rollout manager (:func:`~.manager.get_manager`), in m2flow's Ray namespace
MANAGER_NAME = "m2flow:rollout_manager"
