"""`on_host(fn)`: `fn` traced to run on the host inside a jitted program (XLA compute type
"device_host"), its outputs in host memory: the host-side gathers and scatters of the
pinned_host pool.

JAX's API for this changed: jax 0.10 has `compute_on(compute_type)` as a context
manager and the function transformation as `compute_on2(f, *, compute_type,
out_memory_spaces)`; jax 0.11 removed the context manager and named the transformation
`compute_on` (measured on the GPU machine, jax 0.11.2: `compute_on("device_host")` raises
"missing 2 required keyword-only arguments: 'compute_type' and 'out_memory_spaces'").
This module picks the transformation on both, so every caller runs the same code path
(and the cuda lowering tests on a CPU machine check the one a GPU runs).
"""

from __future__ import annotations

import inspect

import jax
from jax.experimental import compute_on as _co


def _transformation():
  new = getattr(_co, "compute_on2", None)  # jax 0.10: the transformation's name
  if new is not None:
    return new
  if "out_memory_spaces" in inspect.signature(_co.compute_on).parameters:  # jax >= 0.11
    return _co.compute_on
  return None  # an older jax: the context manager only


_COMPUTE_ON = _transformation()


def on_host(fn):
  """`fn`, computed on the host (compute type device_host) with its outputs in host
  memory; call it inside a jitted program on arrays of the pinned_host kind."""
  if _COMPUTE_ON is None:
    def wrapped(*args, **kwargs):
      with _co.compute_on("device_host"):
        return fn(*args, **kwargs)

    return wrapped
  return _COMPUTE_ON(fn, compute_type="device_host",
                     out_memory_spaces=jax.memory.Space.Host)
