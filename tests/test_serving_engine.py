"""The server's engine on the tiny random chat checkpoint, in process: temperature as a per-row input of
one program (the same tokens as a sampler whose schedule is scaled by that temperature), and batch
invariance as docs/serving.md states it: the same request on the same program reproduces its tokens;
alone and inside a batch (another program) it may not, and this test measures how often on this
checkpoint (printed), asserting only what the docs promise."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from diffusiongemma import build
from diffusiongemma import serving
from diffusiongemma.serving import programs
from diffusiongemma.serving.requests import Message, Request

pytestmark = [pytest.mark.slow, pytest.mark.hf]


@pytest.fixture(scope="module")
def engine(chat_checkpoint):
  loaded = build.pretrained(chat_checkpoint, dtype="float32")
  return serving.Engine(loaded.sampler, loaded.weights.variables, loaded.tokenizer, model_name="tiny",
                        max_tokens=8, max_prompt_tokens=64, batch_sizes=(1, 2))


@dataclasses.dataclass(frozen=True)
class _Scaled:
  """A temperature schedule times a fixed `factor` (what a temperature was before it became an input)."""

  schedule: object
  factor: float

  def __call__(self, remaining, total):
    return self.schedule(remaining, total) * jnp.float32(self.factor)


def _prepared(engine, text, seed, temperature=1.0):
  return engine.prepare(Request(kind="chat", model="tiny", messages=(Message("user", text),), seed=seed,
                                temperature=temperature))


def _tokens(engine, preps, shape, sampler=None):
  """The engine's call of `preps` on the program `shape` (with `sampler` instead of its own, when given)."""
  saved = engine.sampler
  engine.sampler = sampler or saved
  try:
    return np.asarray(engine._call(preps, shape, None, on_pass=None).tokens)  # pylint: disable=protected-access
  finally:
    engine.sampler = saved


def test_each_rows_temperature_is_an_input_of_one_program(engine):
  """Row i of a batch with temperatures (0.5, 2.0) is the row of a sampler whose whole schedule is scaled
  by its own temperature (the request's `temperature` as it was a program key before)."""
  pair = programs.Shape(2, 64, 1)
  cold, hot = _prepared(engine, "Cold?", 1, 0.5), _prepared(engine, "Hot?", 2, 2.0)
  mixed = _tokens(engine, [cold, hot], pair)
  scaled = dataclasses.replace(engine.sampler, schedule=_Scaled(engine.sampler.schedule, 0.5))
  reference = _tokens(engine, [dataclasses.replace(cold, temperature=1.0),
                               dataclasses.replace(hot, temperature=1.0)], pair, scaled)
  assert np.array_equal(mixed[0], reference[0])  # the 0.5 row: as the schedule scaled by 0.5
  assert not np.array_equal(mixed[1], reference[1])  # the 2.0 row: not (its own temperature)


def test_the_same_request_on_the_same_program_reproduces_and_batches_are_measured(engine):
  requests = [_prepared(engine, f"Question {i}: {'why ' * i}?", 100 + i) for i in range(4)]
  other = _prepared(engine, "Something else entirely.", 99)
  alone_shape, pair = programs.Shape(1, 64, 1), programs.Shape(2, 64, 1)
  agree = 0
  for request in requests:
    alone = _tokens(engine, [request], alone_shape)[0]
    assert np.array_equal(alone, _tokens(engine, [request], alone_shape)[0])  # reproducible on its program
    first = _tokens(engine, [request, other], pair)[0]
    assert np.array_equal(first, _tokens(engine, [request, other], pair)[0])
    agree += np.array_equal(alone, first)
  print(f"alone (batch 1) vs row 0 of a batch of 2: {agree} of {len(requests)} requests give the same tokens")


def test_the_default_prompt_limit_fits_the_models_context(chat_checkpoint):
  """With no size given, an engine serves the longest prompt bucket up to 1024 that the model's context holds
  beside the longest reply: on a 512-position context 256 (the default was a flat 1024, and a server over such a
  checkpoint refused to start without size flags), and the default reply (256 or the checkpoint's) halves in
  whole canvases until it fits beside the shortest prompt bucket; a size given that does not fit is refused by
  name."""
  loaded = build.pretrained(chat_checkpoint, dtype="float32")
  short = loaded.sampler.replace(model=loaded.sampler.model.clone(
      config=loaded.sampler.model.config.replace(max_positions=512)))
  make = lambda sampler, **sizes: serving.Engine(sampler, loaded.weights.variables, loaded.tokenizer,
                                                 model_name="tiny", **{"max_tokens": 16, **sizes})
  assert make(short).max_prompt_tokens == 256  # prompt buckets 64, 256, 1024: 1024 + 16 > 512
  assert make(loaded.sampler).max_prompt_tokens == 1024 < loaded.sampler.model.config.max_positions - 16
  with pytest.raises(ValueError, match=r"max_prompt_tokens=1024 .* exceed the model's context of 512"):
    make(short, max_prompt_tokens=1024)
  # The default reply, in whole canvases, halves until it fits beside the shortest prompt bucket (64).
  tiny = loaded.sampler.replace(model=loaded.sampler.model.clone(
      config=loaded.sampler.model.config.replace(max_positions=256)))
  reply = lambda sampler, default: serving.Engine(sampler, loaded.weights.variables, loaded.tokenizer,
                                                  model_name="tiny", default_max_tokens=default).max_tokens
  assert reply(loaded.sampler, 256) == 256 and reply(tiny, 100) == 100  # as given where it fits
  assert reply(tiny, 256) == 128  # 256 + 64 > 256
  with pytest.raises(ValueError, match=r"max_tokens=256 \(256 positions\) exceed the model's context of 256"):
    make(tiny, max_tokens=256)  # given: refused by name
