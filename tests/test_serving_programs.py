"""Which compiled program serves a batch, and the background compiler (`serving.programs`, the scheduler's
planning), with a fake engine: no request waits for a compile while a compiled program can serve it, the
start-up grid makes the server "warming" until its covering programs are ready, a group waiting for its
program does not hold the others, temperatures batch together. The real server: tests/test_serving.py."""

import asyncio
import threading

from diffusiongemma.serving import programs
from diffusiongemma.serving import requests as requests_lib
from diffusiongemma.serving.scheduler import Job, Scheduler
from serving_helpers import FakeEngine, FakePrepared, MODEL, shape

CANVAS = 8


def _jobs(loop, *specs):
  """Jobs of (key, prompt bucket, canvases[, temperature])."""
  return [Job(FakePrepared(key, prompt_bucket=p, canvases=k, temperature=(t or [1.0])[0]), loop)
          for key, p, k, *t in specs]


def test_a_batch_joins_requests_while_padding_stays_within_the_bound():
  loop = asyncio.new_event_loop()
  short, long = ("plain", 64, 1), ("plain", 1024, 2)
  jobs = _jobs(loop, short, short, long, ("other", 64, 1), short)
  assert [j.prepared.key for j in programs.select(jobs, 4, CANVAS, 4.0)] == ["plain"] * 4  # one group
  tight = programs.select(jobs, 4, CANVAS, 1.5)
  assert [(j.prepared.prompt_bucket, j.prepared.canvases) for j in tight] == [(64, 1)] * 3  # the long one waits
  assert programs.select(jobs, 2, CANVAS, 4.0) == jobs[:2]  # at most the largest batch
  need = programs.exact([j.prepared for j in jobs[:3]], lambda n: {1: 1, 2: 4, 3: 4, 4: 4}[n])
  assert need == programs.Shape(4, 1024, 2) and need.positions(CANVAS) == 4 * (1024 + 16)
  loop.close()


def test_the_compiler_serves_the_cheapest_covering_program_and_compiles_waiting_requests_first():
  order, gate = [], threading.Event()
  done = threading.Event()

  def compile_fn(s, constraint):
    del constraint
    gate.wait(10)
    order.append(s)

  compiler = programs.Compiler(compile_fn, lambda s, seconds, error: done.set() if len(order) == 4 else None)
  grid = [shape(4, 256, 2), shape(1, 64, 1), shape(4, 64, 1)]
  for s in grid:
    compiler.request(s, priority=2)
  while compiler.compiling != grid[0]:  # the first is being compiled (held by the gate)
    threading.Event().wait(0.01)
  compiler.request(shape(1, 256, 1), priority=0)  # a request waits for it: it goes before the grid's rest
  compiler.request(shape(1, 64, 1), priority=2)  # already queued: not twice
  gate.set()
  assert done.wait(30)
  compiler.stop()
  assert order[0] == grid[0] and order[1] == shape(1, 256, 1) and sorted(order[2:]) == sorted(grid[1:])
  assert compiler.best(shape(1, 64, 1), CANVAS) == shape(1, 64, 1)
  assert compiler.best(shape(2, 100, 1), CANVAS) == shape(4, 256, 2)  # the only one that covers it
  assert compiler.best(shape(1, 64, 1, ("c",)), CANVAS) is None  # other constraint sizes: none


def _run(scenario, engine, **kwargs):
  async def main():
    scheduler = Scheduler(engine, admission_window=0.01, **kwargs)
    await scheduler.start()
    try:
      return await scenario(scheduler, asyncio.get_running_loop())
    finally:
      await scheduler.stop()

  return asyncio.run(main())


async def _answer(job):
  while (await asyncio.wait_for(job.events.get(), 20))[0] != "done":
    pass


def test_warming_until_the_covering_programs_then_no_wait_while_a_compiled_program_serves():
  gate = threading.Event()
  grid = [shape(4, 64, 2, ()), shape(1, 64, 1, ())]
  engine = FakeEngine(compile_gate=gate, grid=grid)

  async def scenario(scheduler, loop):
    assert scheduler.status()["status"] == "warming"
    gate.set()
    await asyncio.wait_for(scheduler.ready.wait(), 20)
    statuses = scheduler.status()
    while scheduler.status()["programs"]["compiling"]:
      await asyncio.sleep(0.01)
    (small,) = _jobs(loop, ("plain", 64, 1))
    scheduler.submit(small)
    await _answer(small)
    gate.clear()  # from here every compilation waits
    (tiny_prompt_two_canvases,) = _jobs(loop, ("plain", 64, 2))
    scheduler.submit(tiny_prompt_two_canvases)
    await _answer(tiny_prompt_two_canvases)  # served by (4, 64, 2) at once, no compile awaited
    deadline = loop.time() + 20  # the compiler thread takes the request up when it next runs (a busy machine)
    while scheduler.compiler.compiling is None and loop.time() < deadline:
      await asyncio.sleep(0.01)
    compiling = scheduler.compiler.compiling  # 4 x 80 positions > 2 x 80: its own, compiled for next time
    gate.set()
    return statuses, compiling

  (statuses, compiling) = _run(scenario, engine, warm_up=1, max_padding=2.0)
  assert statuses["status"] == "ok"
  assert engine.compiled[0] == grid[0]  # the covering program first
  assert engine.shapes == [shape(1, 64, 1), shape(4, 64, 2)]
  assert compiling == shape(1, 64, 2)


def test_a_group_waiting_for_its_program_does_not_hold_the_others_and_temperatures_batch_together():
  gate = threading.Event()
  engine = FakeEngine(compile_gate=gate, grid=[shape(4, 64, 1)])

  async def scenario(scheduler, loop):
    gate.set()
    await asyncio.wait_for(scheduler.ready.wait(), 20)
    gate.clear()  # from here every compilation waits
    waiting = _jobs(loop, ("json", 64, 1))[0]  # a constraint's program: not compiled
    scheduler.submit(waiting)
    await asyncio.sleep(0.2)
    mixed = _jobs(loop, ("plain", 64, 1, 0.3), ("plain", 64, 1, 1.4))
    for job in mixed:
      scheduler.submit(job)
    for job in mixed:
      await _answer(job)
    assert not waiting.events.qsize() and scheduler.status()["queued"] == 1
    gate.set()
    await _answer(waiting)

  _run(scenario, engine, warm_up=1)
  assert engine.batches == [["plain", "plain"], ["json"]]  # two temperatures, one batch
  assert engine.shapes == [shape(4, 64, 1), shape(1, 64, 1, ("json",))]


def test_with_seeded_alone_a_seeded_request_runs_alone_on_its_own_program():
  engine = FakeEngine(grid=[shape(4, 64, 1)])
  request = requests_lib.Request(kind="chat", model=MODEL, seed=7)

  async def scenario(scheduler, loop):
    await asyncio.wait_for(scheduler.ready.wait(), 20)
    seeded = lambda: Job(FakePrepared("plain", request=request), loop)
    jobs = [seeded(), *_jobs(loop, ("plain", 64, 1), ("plain", 64, 1)), seeded()]
    for job in jobs:
      scheduler.submit(job)
    for job in jobs:
      await _answer(job)

  _run(scenario, engine, warm_up=1, seeded_alone=True)
  assert sorted(map(len, engine.batches)) == [1, 1, 2]  # each seeded one alone, the others together
  alone = [s for s, b in zip(engine.shapes, engine.batches) if len(b) == 1]
  assert alone == [shape(1, 64, 1)] * 2  # its own program (compiled for it), not the compiled (4, 64, 1)
