"""The one place that picks how a kernel runs: Pallas (compiled or interpret) or XLA.

Two knobs, resolved here and nowhere else:

* ``interpret`` of each Pallas kernel: ``None`` means interpret mode on CPU (tests
  only; slow) and a compiled kernel on GPU.
* ``backend`` of :func:`ops`: ``"pallas"`` (the kernels), ``"xla"`` (the attention of
  :mod:`kernels_pallas.xla_attention`, shaped for XLA:CPU, with the references' write_kv
  and block_key_bounds), ``"reference"`` (each kernel's pure-jnp reference, jit-compiled,
  same signature: what tests hold the others to) or ``"auto"``/``None``: ``xla`` on
  CPU, ``pallas`` on GPU. TPU also resolves to ``xla``: these kernels keep
  the whole block array of one KV head as a single BlockSpec block, which is free on
  GPU (a pointer into HBM) but would not fit TPU VMEM; a TPU variant would need
  scalar prefetch and manual DMA of the selected blocks.

GPU lowering: Pallas **Triton**. The same kernel body (jnp ops on refs, a vector
gather of blocks through the block table, a dynamic ``fori_loop``) runs in interpret
mode on CPU and lowers through Triton, so the body the CPU tests check is the body a
GPU runs. Mosaic GPU would need a second, warpgroup/TMA-shaped body (64-row wgmma
tiles, shared-memory pipelines) that interpret mode here does not exercise the same
way, and its API moved between jax 0.10 and 0.11. Decode paged attention is bound by
HBM bandwidth with few query rows per KV head, so wgmma gains little. The Triton
backend is deprecated in jax 0.11 (still shipped); moving to Mosaic GPU is a
per-kernel swap behind :func:`compiler_params`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax

BackendName = Literal["auto", "pallas", "xla", "reference"]
BACKENDS = ("pallas", "xla", "reference")


def platform() -> str:
  """The default JAX platform: "cpu", "gpu" or "tpu"."""
  return jax.default_backend()


def resolve_interpret(interpret: bool | None) -> bool:
  """`None` -> interpret mode exactly when running on CPU."""
  if interpret is None:
    return platform() == "cpu"
  return bool(interpret)


def resolve_backend(backend: BackendName | None) -> Literal["pallas", "xla", "reference"]:
  """`"auto"`/`None` -> ``"pallas"`` on GPU, ``"xla"`` on CPU and TPU."""
  if backend in (None, "auto"):
    return "pallas" if platform() == "gpu" else "xla"
  if backend not in BACKENDS:
    raise ValueError(f"backend must be 'auto', 'pallas', 'xla' or 'reference', got {backend!r}")
  return backend


def min_dot_rows(interpret: bool) -> int:
  """Smallest row count of a `dot` operand: Triton's tl.dot needs 16, interpret needs 1."""
  return 1 if interpret else 16


def compiler_params(interpret: bool, *, num_warps: int = 4, num_stages: int = 2) -> Any:
  """Triton compiler parameters on GPU, `None` in interpret mode."""
  if interpret or platform() != "gpu":
    return None
  from jax.experimental.pallas import triton as plgpu  # GPU-only import.

  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def check_triton_sizes(interpret: bool, **sizes: int) -> None:
  """Triton tensors must have power-of-2 sizes; reject others with the names that failed."""
  if interpret:
    return
  bad = {k: v for k, v in sizes.items() if v & (v - 1)}
  if bad:
    raise ValueError(f"the Pallas Triton (GPU) lowering needs power-of-2 sizes, got {bad}")


def _no_hints(q_lens: Sequence[int]) -> dict[str, int]:
  del q_lens
  return {}


class KernelOps(NamedTuple):
  """The four kernels bound to one backend; every field has its kernel's signature.

  `ragged_hints(q_lens)` (host side) gives the static keyword arguments that size
  `ragged_paged_attention` for a batch whose rows have these query lengths (the xla
  backend's prefill tiles; nothing for the others).
  """

  backend: str
  paged_attention: Callable[..., jax.Array]
  ragged_paged_attention: Callable[..., jax.Array]
  write_kv: Callable[..., tuple[jax.Array, jax.Array]]
  block_key_bounds: Callable[..., jax.Array]
  ragged_hints: Callable[[Sequence[int]], dict[str, int]] = _no_hints


def ops(backend: BackendName | None = None) -> KernelOps:
  """The kernels the engine calls, for `backend` (see module docstring)."""
  # Imported here: the kernel modules import this module for `resolve_interpret`. By module
  # path, since the package re-exports functions under the same names as the modules.
  pa, rpa, wkv, bkb, xa = (importlib.import_module(f"kernels_pallas.{m}") for m in (
      "paged_attention", "ragged_paged_attention", "write_kv", "block_key_bounds",
      "xla_attention"))

  name = resolve_backend(backend)
  if name == "pallas":
    return KernelOps(name, pa.paged_attention, rpa.ragged_paged_attention, wkv.write_kv,
                     bkb.block_key_bounds)
  if name == "xla":
    return KernelOps(name, xa.paged_attention_xla, xa.ragged_paged_attention_xla,
                     wkv.write_kv_reference, bkb.block_key_bounds_reference, xa.ragged_hints)
  return KernelOps(name, pa.paged_attention_reference, rpa.ragged_paged_attention_reference,
                   wkv.write_kv_reference, bkb.block_key_bounds_reference)
