"""Rollout: the rollout role (:mod:`.worker`) and its options (:mod:`.config`, the workflows'
``rollout`` section), its generation engines (:mod:`.engines`: Hugging Face ``generate`` from
:mod:`m2flow.workers.llm.generation`, :mod:`.exact`, :mod:`.vllm_engine`, :mod:`.emulated`),
and the spot rollout pool that the role runs a step through with ``rollout.spot.enabled``
(:mod:`.spot`). Greedy held-out evaluation is :mod:`m2flow.workers.scoring.evaluation`."""
