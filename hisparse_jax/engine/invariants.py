"""The engine's invariants between steps (Engine.check_invariants; tests and the state
machine tests call it after every step)."""

from __future__ import annotations

from hisparse_jax.engine.request import RequestStatus


def check_engine(engine) -> None:
  """Block-manager invariants plus: the engine holds exactly the unfinished requests,
  each in one scheduler queue, and only they hold blocks."""
  engine.block_manager.check_invariants()
  sched = engine.scheduler
  queued = [r.request_id for r in [*sched.waiting, *sched.running, *sched.swapped,
                                   *sched.loading]]
  queued += [c.request_id for r in engine.requests.values() for c in r.pending_children]
  assert sorted(queued) == sorted(engine.requests), (queued, sorted(engine.requests))
  reserved = sum(len(r.pending_children) for r in [*sched.running, *sched.swapped])
  assert sched.num_reserved_seats == reserved, (sched.num_reserved_seats, reserved)
  assert len(sched.running) + reserved <= sched.max_num_seqs
  assert sorted(engine._groups) == sorted(
      {r.group.request_id for r in engine.requests.values() if r.group is not None})
  assert all(not r.is_finished for r in engine.requests.values())
  assert set(engine.block_manager.seq_ids) <= set(engine.requests), engine.block_manager.seq_ids
  for request in sched.running:
    assert request.status == RequestStatus.RUNNING and request.request_id in engine.block_manager
  for request in sched.swapped:
    assert request.status == RequestStatus.SWAPPED and request.request_id in engine.block_manager
