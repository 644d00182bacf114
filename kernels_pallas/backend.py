"""The one place that picks how a kernel runs: Pallas (compiled or interpret) or XLA.

Two knobs, resolved here and nowhere else:

* ``interpret`` of each Pallas kernel: ``None`` means interpret mode on CPU (tests
  only; slow) and a compiled kernel on GPU.
* the **target** platform: what the program is lowered for, by default the platform
  this process runs on. ``ops(backend, platform="gpu")`` binds the kernels compiled
  (``interpret=False``, Triton compiler parameters) whatever the host, so that
  ``jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))`` lowers the GPU
  program from a CPU-only machine (``tests/kernels_pallas/test_lowering_cuda.py``).
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
per-kernel swap behind :func:`compiler_params`. The first swap is opt-in:
``ops("pallas_mgpu", platform="gpu")`` binds the decode kernel of
:mod:`kernels_pallas.paged_attention_mgpu` (Mosaic GPU: WGMMA, TMA copies of the listed
blocks into shared memory), the ragged kernel of
:mod:`kernels_pallas.ragged_paged_attention_mgpu` where its limits allow (16-bit pages,
else the Triton one) and the Triton kernels for the other two.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax

BackendName = Literal["auto", "pallas", "pallas_mgpu", "xla", "reference"]
BACKENDS = ("pallas", "pallas_mgpu", "xla", "reference")


PLATFORMS = ("cpu", "gpu", "tpu")
# Lowering-platform names (`lowering_platforms=`) and what they target here.
_PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu"}


def platform() -> str:
  """The default JAX platform: "cpu", "gpu" or "tpu"."""
  return jax.default_backend()


def target_platform(target: str | None = None) -> str:
  """The platform a program is built for: `target` ("cpu", "gpu", "tpu"; "cuda" and
  "rocm" mean "gpu"), or this process's platform when None."""
  if target is None:
    return platform()
  name = _PLATFORM_ALIASES.get(target, target)
  if name not in PLATFORMS:
    raise ValueError(f"platform must be one of cpu, gpu, cuda, rocm or tpu, got {target!r}")
  return name


def context_platform() -> str:
  """The platform kernels traced here lower for: "gpu" inside an abstract GPU context
  (`abstract_gpu`, what a deviceless build for a GPU traces in), else this process's
  platform. For kernels with no target of their own to be told (the block copies of
  tier moves, built beside the engine's kernel ops)."""
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None)
  if device is not None and _PLATFORM_ALIASES.get(device.platform) == "gpu":
    return "gpu"
  return platform()


def resolve_interpret(interpret: bool | None, target: str | None = None) -> bool:
  """`None` -> interpret mode exactly when the target platform is CPU."""
  if interpret is None:
    return target_platform(target) == "cpu"
  return bool(interpret)


def resolve_backend(backend: BackendName | None, target: str | None = None
                    ) -> Literal["pallas", "pallas_mgpu", "xla", "reference"]:
  """`"auto"`/`None` -> ``"pallas"`` on GPU, ``"xla"`` on CPU and TPU."""
  if backend in (None, "auto"):
    return "pallas" if target_platform(target) == "gpu" else "xla"
  if backend not in BACKENDS:
    raise ValueError("backend must be 'auto', 'pallas', 'pallas_mgpu', 'xla' or 'reference', "
                     f"got {backend!r}")
  return backend


def min_dot_rows(interpret: bool) -> int:
  """Smallest row count of a `dot` operand: Triton's tl.dot needs 16, interpret needs 1."""
  return 1 if interpret else 16


def compiler_params(interpret: bool, *, num_warps: int = 4, num_stages: int = 2) -> Any:
  """Triton compiler parameters for a compiled kernel, `None` in interpret mode.

  Given whatever the host: the parameters' type is what selects the Triton lowering of
  `pallas_call` for "cuda"/"rocm" (with none, jax picks Mosaic GPU, which these
  whole-pool BlockSpecs do not fit), and a compiled kernel runs nowhere but a GPU.
  """
  if interpret:
    return None
  from jax.experimental.pallas import triton as pltriton

  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def check_triton_sizes(interpret: bool, **sizes: int) -> None:
  """Triton tensors must have power-of-2 sizes; reject others with the names that failed.

  Only for sizes a kernel cannot pad: head_dim and the GQA group are padded inside the
  kernels (any value is accepted); what remains are the KV block size (a tile of the
  pool) and the tuning knobs' tile sizes.
  """
  if interpret:
    return
  bad = {k: v for k, v in sizes.items() if v < 1 or v & (v - 1)}
  if bad:
    raise ValueError(
        f"the Pallas Triton (GPU) lowering needs power-of-2 tile sizes, got {bad} (Triton "
        "tensors have power-of-2 sizes; head_dim and the GQA group are padded by the "
        "kernels, these are not: use a power-of-2 block_size and knobs)")


def abstract_gpu(device_kind: str = "NVIDIA H200", num_cores: int | None = 132
                 ) -> contextlib.AbstractContextManager[None]:
  """A context within which Pallas lowers GPU kernels for `device_kind` whatever the
  host: an abstract mesh whose ``AbstractDevice`` is that CUDA GPU (`num_cores`: its SMs;
  an H100/H200 has 132).

  From jax 0.11 the Triton lowering of ``pallas_call`` asks the context's abstract mesh
  for the GPU it targets (else the default device: a CPU-only host has none, "RuntimeError:
  No supported GPU devices found, please specify an abstract GPU device using
  AbstractDevice"). Wrap ``trace(...).lower(lowering_platforms=("cuda",))`` in it (the
  trace is what counts: a traced program keeps its context's mesh, and its lowering
  re-enters it). The mesh has no axes: a mesh with axes (``AbstractMesh((1,), ("x",))``) would
  make every lowered op carry an ``sdy.sharding_constraint`` over an ``sdy.mesh`` of its
  own, and jax refuses it beside arrays sharded over a real mesh ("context mesh ... should
  match the aval mesh"). So the arrays keep their own (CPU) devices, shardings and memory
  kinds; only the kernels' target GPU comes from here. A no-op context on jax versions
  without ``AbstractDevice`` (they lowered Triton kernels without asking)."""
  try:
    from jax._src.mesh import AbstractDevice, AbstractMesh  # noqa: PLC0415
  except ImportError:
    return contextlib.nullcontext()
  device = AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="cuda")
  return jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=device))


def _no_hints(q_lens: Sequence[int]) -> dict[str, int]:
  del q_lens
  return {}


def _no_hints_cover(hints: dict[str, int], q_lens: Sequence[int]) -> bool:
  del q_lens
  return not hints


class KernelOps(NamedTuple):
  """The kernels bound to one backend; every field has its kernel's signature (the four
  of llama-family models, and DSA models' sparse_mla_decode: the Triton kernel for
  pallas, the Mosaic GPU one for pallas_mgpu, its reference for xla and reference).

  `ragged_hints(q_lens)` (host side) gives the static keyword arguments that size
  `ragged_paged_attention` for a batch whose rows have these query lengths (the xla
  backend's prefill tiles; nothing for the others). `hints_cover(hints, q_lens)`: whether
  a call with the static sizes `hints` computes rows of these query lengths.
  """

  backend: str
  paged_attention: Callable[..., jax.Array]
  ragged_paged_attention: Callable[..., jax.Array]
  write_kv: Callable[..., tuple[jax.Array, jax.Array]]
  block_key_bounds: Callable[..., jax.Array]
  ragged_hints: Callable[[Sequence[int]], dict[str, int]] = _no_hints
  hints_cover: Callable[[dict[str, int], Sequence[int]], bool] = _no_hints_cover
  # DSA models' attention (kernels_pallas.sparse_mla): each query over its listed tokens.
  sparse_mla_decode: Callable[..., jax.Array] | None = None
  # HiSparse's block scores from the key bounds read in place (kernels_pallas.block_scores;
  # the GPU backends). None: the indexer gathers the bounds and scores them in jnp (or the
  # C++ select on an XLA:CPU target).
  block_scores: Callable[..., jax.Array] | None = None
  # DSA's lightning-indexer scores from the paged indexer keys read in place
  # (kernels_pallas.index_scores; the GPU backends). None: gathered and scored in jnp.
  index_scores: Callable[..., jax.Array] | None = None


@functools.cache  # the same KernelOps (a static argument of the step) per backend
def ops(backend: BackendName | None = None, *, platform: str | None = None,
        pages_dtype: str | None = None) -> KernelOps:
  """The kernels the engine calls, for `backend` (see module docstring), built for the
  `platform` target (None: this process's platform). The Pallas kernels come bound to
  `interpret` = the target is CPU. `pages_dtype`: the dtype the attention reads the KV
  pages in, where the caller knows it (None: any); "float32" for the xla backend on a
  CPU target with the C++ kernels built gives `kernel_hints` (every prefill row in the
  C++ kernel: one program for prompts of any length)."""
  # Imported here: the kernel modules import this module for `resolve_interpret`. By module
  # path, since the package re-exports functions under the same names as the modules.
  pa, rpa, wkv, bkb, xa, smla, bsc, isc = (
      importlib.import_module(f"kernels_pallas.{m}") for m in (
          "paged_attention", "ragged_paged_attention", "write_kv", "block_key_bounds",
          "xla_attention", "sparse_mla", "block_scores", "index_scores"))

  name = resolve_backend(backend, platform)
  if name == "pallas":
    bind = functools.partial(functools.partial, interpret=resolve_interpret(None, platform))
    return KernelOps(name, bind(pa.paged_attention), bind(rpa.ragged_paged_attention),
                     bind(wkv.write_kv), bind(bkb.block_key_bounds),
                     sparse_mla_decode=bind(smla.sparse_mla_decode),
                     block_scores=bind(bsc.block_scores), index_scores=bind(isc.index_scores))
  if name == "pallas_mgpu":
    # The decode kernels on Mosaic GPU (paged: bf16/f16 or 8-bit pages read as either,
    # block_size a multiple of 8, head_dim a multiple of 32, where its limits allow:
    # `_paged_mgpu_or_triton`; DSA's sparse MLA: bf16/f16, kv_lora_rank a multiple of 64,
    # rope 64, refused at start otherwise; see their modules), the ragged one where its
    # limits allow (`_ragged_mgpu_or_triton`), the other two on Triton. Compiled only: their CPU
    # interpreter (InterpretGPUParams) is what tests/kernels_pallas/test_mgpu_*.py run.
    if target_platform(platform) != "gpu":
      raise ValueError(f"backend 'pallas_mgpu' targets a GPU, got platform {platform!r}")
    pam, smlam = (importlib.import_module(f"kernels_pallas.{m}")
                  for m in ("paged_attention_mgpu", "sparse_mla_mgpu"))
    bind = functools.partial(functools.partial, interpret=False)
    ragged = functools.partial(_ragged_mgpu_or_triton, bind(rpa.ragged_paged_attention))
    paged = functools.partial(_paged_mgpu_or_triton, bind(pam.paged_attention_mgpu),
                              bind(pa.paged_attention))
    return KernelOps(name, paged, ragged,
                     bind(wkv.write_kv), bind(bkb.block_key_bounds),
                     sparse_mla_decode=bind(smlam.sparse_mla_decode_mgpu),
                     block_scores=bind(bsc.block_scores), index_scores=bind(isc.index_scores))
  if name == "xla":
    cpu_kernels = importlib.import_module("kernels_pallas.cpu_kernels")
    kernel = (pages_dtype == "float32" and target_platform(platform) == "cpu"
              and cpu_kernels.available())
    return KernelOps(name, xa.paged_attention_xla, xa.ragged_paged_attention_xla,
                     wkv.write_kv_reference, bkb.block_key_bounds_reference,
                     xa.kernel_hints if kernel else xa.ragged_hints, xa.hints_cover,
                     smla.sparse_mla_decode_reference)
  return KernelOps(name, pa.paged_attention_reference, rpa.ragged_paged_attention_reference,
                   wkv.write_kv_reference, bkb.block_key_bounds_reference,
                   sparse_mla_decode=smla.sparse_mla_decode_reference)


# The keywords both paged decode kernels take (the engine passes no others).
_PAGED_COMMON_KWARGS = {"sm_scale", "soft_cap", "num_splits", "return_lse"}


def _paged_mgpu_or_triton(mgpu_paged: Callable[..., jax.Array],
                          triton_paged: Callable[..., jax.Array], q, k_pages, v_pages, *args,
                          **kwargs):
  """The "pallas_mgpu" backend's paged decode: the Mosaic GPU kernel
  (:mod:`kernels_pallas.paged_attention_mgpu`) within its limits, else `triton_paged`
  (head_dim not a multiple of 32, e.g. 80; block sizes not a multiple of 8; float32 pages;
  more than 64 query heads per KV head). Decided at trace time from the shapes, so one
  lowered program holds one of the two (`hisparse-jax compile` lists which)."""
  pam = importlib.import_module("kernels_pallas.paged_attention_mgpu")
  if pam.supports(q, k_pages) and not kwargs.keys() - _PAGED_COMMON_KWARGS:
    return mgpu_paged(q, k_pages, v_pages, *args, **kwargs)
  return triton_paged(q, k_pages, v_pages, *args, **kwargs)


def _ragged_mgpu_or_triton(triton_ragged: Callable[..., jax.Array], q, k_pages, v_pages,
                           *args, **kwargs) -> jax.Array:
  """The "pallas_mgpu" backend's ragged attention: the Mosaic GPU kernel
  (:mod:`kernels_pallas.ragged_paged_attention_mgpu`) for 16-bit pages within its limits,
  else `triton_ragged` (8-bit pages, float32, block sizes not a multiple of 8, ...).
  Decided at trace time from the shapes, so one lowered program holds one of the two."""
  ragm = importlib.import_module("kernels_pallas.ragged_paged_attention_mgpu")
  if ragm.supports(q, k_pages) and not kwargs.keys() - {"sm_scale", "soft_cap",
                                                        "sliding_window"}:
    return ragm.ragged_paged_attention_mgpu(q, k_pages, v_pages, *args, interpret=False,
                                            **kwargs)
  return triton_ragged(q, k_pages, v_pages, *args, **kwargs)
