"""The rollout chunk record: its derived fields, and that channels send it by object-store
reference (a tuple of tensors), tensors intact. No Ray."""

from __future__ import annotations

import subprocess
import sys

import torch
from m2flow.workers.chunk import RolloutChunk
from tensordict import TensorDict

from m2flow.core.channel_codec import needs_object_store, pack, unpack


def _chunk(version: int = 3) -> RolloutChunk:
    batch = TensorDict(
        {"group_index": torch.tensor([7, 7, 9, 9]), "logprobs": torch.randn(4, 5)},
        batch_size=[4],
    )
    entries = {7: {"ground_truth": "1"}, 9: {"ground_truth": "2"}}
    return RolloutChunk(batch, entries=entries, weight_version=version, step=2, step_samples=16)


def test_key_staleness_and_row_entries():
    c = _chunk(version=3)
    assert c.key == 7 and c.num_samples == 4
    assert c.stale_samples(3) == 0 and c.stale_samples(4) == 4
    assert [e["ground_truth"] for e in c.row_entries()] == ["1", "1", "2", "2"]
    # step and step_samples default to 0 (unknown): the reward worker's "a batch of its own"
    bare = RolloutChunk(c.batch, entries={}, weight_version=0)
    assert bare.step == 0 and bare.step_samples == 0


def test_channels_send_it_by_reference_with_its_tensors():
    c = _chunk()
    assert needs_object_store(c)  # not pickled into the channel actor's mailbox
    body, buffers = pack(c)
    assert buffers  # the tensors' bytes travel out of band
    got = unpack((body, buffers))
    assert isinstance(got, RolloutChunk)
    assert (got.key, got.weight_version, got.step, got.step_samples) == (7, 3, 2, 16)
    assert got.entries == c.entries and torch.equal(got.batch["logprobs"], c.batch["logprobs"])


def test_algorithm_modules_import_without_transformers():
    """GRPO and PPO math need torch only; logprobs (KV cache) brings transformers."""
    code = (
        "import sys\n"
        "from m2flow.workers.algos import gae, grpo_loss\n"
        "from m2flow.workers.algos.ppo import token_rewards\n"
        "assert 'transformers' not in sys.modules, 'algos.grpo/ppo imported transformers'\n"
        "from m2flow.workers.algos import sequence_logprobs\n"
        "assert 'transformers' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
