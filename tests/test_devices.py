"""Device placement without a GPU: the class of bug that stopped the first GRPO step on CUDA.

On a GPU the model's tensors live on ``cuda:0`` and a batch arrives on the host; a tensor made
in between on the wrong device fails with "Expected all tensors to be on the same device". Two
CPU stand-ins catch that class here:

- the model's side on the ``meta`` device: a function given meta logits must not mix in a tensor
  it made on the host (the counter uniforms of the sampler did; meta raises "Tensor on device
  meta is not on the expected device cpu");
- a rollout, a GRPO actor step and a critic step under :class:`DeviceNamed`, which records
  every tensor factory call (``torch.zeros``, ``torch.tensor``, ``torch.arange``, ...) made
  from m2flow's own code without a ``device=``: such a tensor lands on the default device (the
  host) whatever device the model is on. Host tensors (batches between workers) say
  ``device="cpu"``; the rest derive theirs (``x.new_zeros``, ``zeros_like``, ``device=``).
  (``torch.set_default_device("meta")`` would do the same, but transformers' own mask code
  builds index tensors on the default device, so a model forward cannot run under it.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from m2flow.workers.algos.grpo import grpo_advantages
from m2flow.workers.algos.losses import make_loss, response_values
from m2flow.workers.algos.ppo import gae
from m2flow.workers.batch import concat, to_batch
from m2flow.workers.engines.torch_engine import TorchEngine, TorchValueEngine
from m2flow.workers.engines.update import StreamedStep, minibatch_update, value_update
from m2flow.workers.engines.value_model import ValueModel
from m2flow.workers.llm import ModelConfig, build_char_tokenizer, build_model
from m2flow.workers.llm.generation import generate
from m2flow.workers.llm.sampling import sample_tokens
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

TINY = ModelConfig(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
)
PROMPTS = ["1+2=", "12+34-5=", "7-3="]
KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
ROOT = Path(__file__).resolve().parent.parent
OURS = tuple(str(ROOT / d) for d in ("workers", "m2flow", "scheduler"))


class DeviceNamed(TorchFunctionMode):
    """Records ``file:line`` of every tensor factory call from m2flow's code that names no
    ``device`` (calls from libraries, e.g. transformers, are theirs)."""

    FACTORIES = _device_constructors()

    def __init__(self) -> None:
        super().__init__()
        self.unnamed: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FACTORIES and kwargs.get("device") is None:
            caller = sys._getframe(1)  # the frame that called the factory
            if caller.f_code.co_filename.startswith(OURS):
                where = Path(caller.f_code.co_filename).relative_to(ROOT)
                self.unnamed.append(f"{where}:{caller.f_lineno} torch.{func.__name__}")
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampler_follows_the_logits_device(top_p):
    """Host uniforms (counter-based, from numpy) meet logits on the model's device."""
    logits = torch.randn(4, 11, device="meta")
    u = torch.rand(4, dtype=torch.float64)  # made on the host, as counter_uniforms are
    tok = sample_tokens(logits, u, temperature=0.7, top_p=top_p)
    assert tok.device.type == "meta" and tok.shape == (4,) and tok.dtype == torch.long
    # The same draw on the host: inverse CDF of softmax(logits / T).
    host = torch.randn(4, 11)
    got = sample_tokens(host, u, temperature=0.7, top_p=top_p)
    assert ((got >= 0) & (got < 11)).all()


def test_gae_follows_its_inputs_device():
    values = torch.zeros(4, 3, device="meta")
    adv, ret = gae(torch.zeros(4, 3, device="meta"), values, torch.zeros(4, 3, device="meta"),
                   values.new_zeros(4), 1.0, 0.95)  # fmt: skip
    assert adv.device.type == ret.device.type == "meta"
    # grpo_advantages needs torch.unique (no meta kernel): the DeviceNamed test covers it.


def _rollout(model, tok, **kw):
    prompts = [tok(p).input_ids for p in PROMPTS]
    return generate(model, tok, prompts, n_samples=4, max_new_tokens=5, temperature=1.0, **kw)


def _actor_step(model, out) -> tuple[dict, dict]:
    data = {k: out[k] for k in KEYS}
    data["advantages"] = grpo_advantages(out["rewards"], out["group_index"])
    data["old_logprobs"] = out["logprobs"]
    engine = TorchEngine.from_module(model, lr=1e-3, temperature=1.0)
    loss = make_loss("grpo", "policy")
    mini = minibatch_update(engine, data, loss, 6, 4)
    step = StreamedStep(engine, loss, micro_batch_size=5)
    step.add(data)
    streamed = step.finish()
    return mini, streamed


def _critic_step(tok, out) -> dict:
    critic = TorchValueEngine.__new__(TorchValueEngine)
    critic._setup(ValueModel(TINY, tok, seed=0), lr=1e-3)
    batch = dict(out)
    batch["old_values"] = critic.infer(batch, response_values, micro_batch_size=5)
    batch["returns"] = out["rewards"][:, None].expand_as(batch["old_values"]).clone()
    gen = torch.Generator().manual_seed(0)
    loss = make_loss("value", "value", value_clip=0.2)
    return value_update(critic, batch, loss, 6, None, epochs=2, generator=gen)


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_rollout_and_training_name_every_device(tok, shared_prefix):
    """A rollout (sampled with counter keys, and greedy), one GRPO actor step (mini-batches
    and streaming accumulation) and one critic step create no tensor on the default device."""
    model = build_model(TINY, tok, seed=3)
    keys = [(7, g) for g in range(len(PROMPTS))]
    with DeviceNamed() as mode:
        out = _rollout(model, tok, sample_keys=keys, seed=1, shared_prefix=shared_prefix)
        _rollout(model, tok, greedy=True, shared_prefix=shared_prefix)
        out["rewards"] = (out["response_ids"][:, 0] % 2).float()
        concat([to_batch(out), to_batch(out)], tok.pad_token_id)
        mini, streamed = _actor_step(model, out)
        _critic_step(tok, out)
    assert mode.unnamed == []
    assert mini["steps"] == 2 and streamed["steps"] == 1  # the steps ran


def test_device_named_catches_an_unnamed_factory():
    """The check itself: an unnamed factory in our code is reported with its place."""
    from m2flow.workers import batch

    with DeviceNamed() as mode:
        batch._pad(torch.ones(2, 3, dtype=torch.long), 5, 0, left=True)  # names its device
        torch.zeros(3)  # this test file is not m2flow's code: not reported
    assert mode.unnamed == []
    source = "def f():\n    return torch.arange(3)\n"
    scope = {"torch": torch}
    exec(compile(source, str(ROOT / "workers" / "probe.py"), "exec"), scope)
    with DeviceNamed() as mode:
        scope["f"]()
    assert mode.unnamed == ["workers/probe.py:2 torch.arange"]
