"""Injected faults: a transfer or a part of a step raises once; only the requests that step
could have spoiled end, with finish_reason "error" and the message, their blocks are freed,
and every other request gives the tokens of an unfaulted run.

The six prompts of test_engine on its small device pool (swap-outs and swap-ins happen),
greedy. Each fault raises the first time its point is reached in the step chosen; the
affected requests are `Engine._fail_step`'s rule: the step's scheduled requests, and when
the block moves themselves failed, also the requests that step swapped out or in.
"""

import pytest
from engine_fixtures import (
  SIX_PROMPTS,
  add_all,
  assert_all_blocks_free,
  make_engine,
  reference_greedy,
  run,
  tiny_model,
)

from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.observability import metrics as m

PROMPTS = SIX_PROMPTS
NUM_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)


class Injected(RuntimeError):
  pass


@pytest.fixture(scope="module")
def reference():
  return reference_greedy(tiny_model(), PROMPTS, NUM_TOKENS)


def _record(engine):
  """Keeps every step's SchedulerOutput."""
  log, schedule = [], engine.scheduler.schedule

  def recording():
    out = schedule()
    log.append(out)
    return out

  engine.scheduler.schedule = recording
  return log


def _fail_once(obj, name, when, steps):
  """Makes `obj.name(*args)` raise Injected the first time `when(*args)` holds; returns a
  list that gets the SchedulerOutput of the step that failed."""
  original = getattr(obj, name)
  failed_step = []

  def wrapper(*args):
    if not failed_step and when(*args):
      failed_step.append(steps[-1])  # schedule() ran first in this step
      raise Injected(f"{name} failed")
    return original(*args)

  setattr(obj, name, wrapper)
  return failed_step


FAULT_STEP = 6  # faults not tied to a transfer: the 6th step (some requests run, some wait)
FAULTS = {
    # name: (engine attribute, method, when it fails, whether it is one of the block moves)
    "d2h transfer": ("transfer", "_dispatch", lambda d, *_: d == m.DIRECTION_D2H, True),
    "h2d transfer": ("transfer", "_dispatch", lambda d, *_: d == m.DIRECTION_H2D, True),
    "copy-on-write copies": ("runner", "copy_blocks", None, True),
    "batch building": ("runner", "build_batch", None, False),
    "jitted step": ("runner", "dispatch", None, False),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fault_ends_only_the_requests_it_touched(fault, reference):
  target, method, when, in_moves = FAULTS[fault]
  engine = make_engine()
  steps = _record(engine)
  when = when or (lambda *_: len(steps) == FAULT_STEP)
  failed_step = _fail_once(getattr(engine, target), method, when, steps)
  add_all(engine, PROMPTS, GREEDY)
  outputs = run(engine)
  assert failed_step, f"{fault}: the fault point was never reached"
  (step,) = failed_step
  assert {"d2h transfer": step.swap_out, "h2d transfer": step.swap_in}.get(fault, True)
  expected = {c.request.request_id for c in step.chunks}
  if in_moves:
    expected |= {r.request_id for r in step.preempted + step.swapped_in}
  failed = {rid for rid, o in outputs.items() if o.outputs[0].finish_reason == "error"}
  assert failed == expected and 0 < len(failed) < len(PROMPTS), (fault, failed, expected)
  for rid in failed:
    assert outputs[rid].error == f"Injected: {method} failed"
  for i in range(len(PROMPTS)):
    if f"r{i}" not in failed:
      assert outputs[f"r{i}"].outputs[0].finish_reason == "length"
      assert outputs[f"r{i}"].error is None
      assert outputs[f"r{i}"].outputs[0].token_ids == reference[i], (fault, i)
  assert engine.metrics()['hisparse_requests_total{finish_reason="error"}'] == len(failed)
  assert_all_blocks_free(engine)
  # The engine goes on: a failed request's prompt again gives its unfaulted tokens.
  i = int(min(failed)[1:])
  engine.add_request("again", prompt_token_ids=PROMPTS[i], sampling_params=GREEDY)
  assert run(engine)["again"].outputs[0].token_ids == reference[i]
  assert_all_blocks_free(engine)


def test_faults_in_a_row_lose_no_request(reference):
  # Every third jitted step fails: each request either finishes normally with its
  # unfaulted tokens or ends once with "error"; nothing is lost, nothing leaks.
  engine = make_engine()
  dispatch, count = engine.runner.dispatch, []

  def flaky(batch, prev_tokens=None):
    count.append(1)
    if len(count) % 3 == 0:
      raise Injected("dispatch failed")
    return dispatch(batch, prev_tokens)

  engine.runner.dispatch = flaky
  add_all(engine, PROMPTS, GREEDY)
  outputs = run(engine)
  assert sorted(outputs) == sorted(f"r{i}" for i in range(len(PROMPTS)))
  reasons = {o.outputs[0].finish_reason for o in outputs.values()}
  assert reasons <= {"length", "error"} and "error" in reasons
  for i in range(len(PROMPTS)):
    out = outputs[f"r{i}"]
    if out.outputs[0].finish_reason == "length":
      assert out.outputs[0].token_ids == reference[i]
    else:
      assert out.error == "Injected: dispatch failed"
      assert out.outputs[0].token_ids == reference[i][:len(out.outputs[0].token_ids)]
  assert_all_blocks_free(engine)
