"""GPU targets for compiling without a GPU: XLA's GPU compiler runs deviceless.

A target is XLA's `GpuTargetConfig` (a text proto: the device's limits, compute
capability, memory size, cuDNN and CUDA runtime versions). From it,
`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)` gives
devices with no hardware behind them; a program traced over `jax.ShapeDtypeStruct`s on
those devices and `.compile()`d runs XLA's whole GPU pipeline (host offloader, fusion,
Triton, PTX -> cubin) and answers `memory_analysis()`. But a topology's devices have no
memories (a sharding's memory_kind on them is None), so programs are traced over this
host's CPU shardings, lowered for "cuda", and their StableHLO compiled by the topology's
compile-only client (engine/aot_compile.py). Pallas kernels lower for the GPU inside
`kernel_context()` (the device kind and core count they build for).

    target = load_target("h200")                  # configs/gpu_targets/h200.textproto
    topo = target.topology(num_devices=1)         # needs jax's CUDA plugin installed
    with target.kernel_context():   # Pallas builds its kernels for this GPU
      lowered = jax.jit(f).trace(*cpu_sharded_args).lower(lowering_platforms=("cuda",))
    topo.devices[0].client.compile(lowered.compiler_ir("stablehlo"), ...)

Named targets: h200, h100 (sm_90), a100 (sm_80), written by hand from public figures; a
path to a `.textproto` file names any other (the one a real device reports:
`jax.lib.xla_client.get_topology_for_devices(jax.devices()).target_config`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

NAMED_TARGETS = ("h200", "h100", "a100")
# The share of device memory JAX's GPU client takes at start (XLA_PYTHON_CLIENT_MEM_FRACTION;
# jax's default): its allocator's bytes_limit, what memory_stats() reports and the capacity
# planner divides.
DEFAULT_MEM_FRACTION = 0.75


class TargetError(ValueError):
  """A target that cannot be read or built (named in the message)."""


def _targets_dir() -> str:
  import configs  # noqa: PLC0415 (the package data's folder, installed or in a checkout)

  return os.path.join(os.path.dirname(os.path.abspath(configs.__file__)), "gpu_targets")


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """One GPU kind to compile for. `config_text`: XLA's GpuTargetConfig text proto."""

  name: str
  config_text: str
  device_kind: str  # device_description_str: what jax.Device.device_kind says
  core_count: int  # streaming multiprocessors
  compute_capability: tuple[int, int]
  memory_bytes: int  # device_memory_size

  @property
  def sm(self) -> str:
    return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"

  def bytes_limit(self) -> int:
    """The device bytes JAX's allocator may use on this GPU (what memory_stats() calls
    bytes_limit): XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) of the device memory."""
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION))
    return int(self.memory_bytes * fraction)

  def topology(self, num_devices: int = 1):
    """The deviceless topology of `num_devices` GPUs of this kind (one host)."""
    return _topology(self.config_text, num_devices)

  def kernel_context(self):
    """The context Pallas lowers its GPU kernels for this target in (an abstract mesh
    whose device is this GPU: kernels_pallas.backend.abstract_gpu)."""
    import kernels_pallas  # noqa: PLC0415

    return kernels_pallas.backend.abstract_gpu(self.device_kind, self.core_count)

  def compile(self, lowered):
    """A one-device program lowered for "cuda" (in `kernel_context()`), compiled by XLA's
    GPU compiler for this target with no GPU: the executable (never loaded), which
    answers `get_compiled_memory_stats()`. The engine's programs, of one device or many,
    go through engine/aot_compile.py instead (their own options, SPMD)."""
    import numpy as np  # noqa: PLC0415
    from jax._src import compiler  # noqa: PLC0415 (compile options: no public API yet)
    from jax._src.lib import xla_client as xc  # noqa: PLC0415

    device = self.topology(1).devices[0]
    options = compiler.get_compile_options(num_replicas=1, num_partitions=1,
                                           device_assignment=np.zeros((1, 1), int))
    return device.client.compile(lowered.compiler_ir("stablehlo"),
                                 executable_devices=xc.DeviceList((device,)),
                                 compile_options=options)


@functools.cache
def _topology(config_text: str, num_devices: int):
  from jax.experimental import topologies  # noqa: PLC0415

  try:
    return topologies.get_topology_desc(platform="cuda", target_config=config_text,
                                        topology=f"1x1x{num_devices}")
  except Exception as e:  # jax raises RuntimeError / JaxRuntimeError / ValueError here
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if "Unknown backend" in first or "cuda" in first.lower() and "plugin" in first.lower():
      raise TargetError("--target: XLA's GPU compiler is not installed in this Python "
                        "(pip install 'jax[cuda13]'; make setup does)") from None
    raise TargetError(f"--target: the GPU topology could not be built: {first}") from None


def _field(text: str, name: str, source: str) -> str:
  m = re.search(rf"\b{name}\s*:\s*(\"[^\"]*\"|[\w.]+)", text)
  if m is None:
    raise TargetError(f"--target={source}: the target config has no {name}")
  return m.group(1).strip('"')


def parse_target(text: str, name: str) -> GpuTarget:
  """A GpuTarget from a GpuTargetConfig text proto (TargetError naming what is missing)."""
  cc = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", text)
  if cc is None:
    raise TargetError(f"--target={name}: the target config has no cuda_compute_capability "
                      "(only NVIDIA targets are built)")
  major = re.search(r"major\s*:\s*(\d+)", cc.group(1))
  minor = re.search(r"minor\s*:\s*(\d+)", cc.group(1))
  try:
    return GpuTarget(name=name, config_text=text,
                     device_kind=_field(text, "device_description_str", name),
                     core_count=int(_field(text, "core_count", name)),
                     compute_capability=(int(major.group(1)) if major else 0,
                                         int(minor.group(1)) if minor else 0),
                     memory_bytes=int(_field(text, "device_memory_size", name)))
  except ValueError as e:
    if isinstance(e, TargetError):
      raise
    raise TargetError(f"--target={name}: a field of the target config is not a number: "
                      f"{e}") from None


def load_target(name_or_path: str) -> GpuTarget:
  """A named target (h200, h100, a100: configs/gpu_targets/NAME.textproto) or a target
  config file; TargetError naming the flag otherwise."""
  key = name_or_path.strip().lower()
  if key in NAMED_TARGETS:
    path = os.path.join(_targets_dir(), f"{key}.textproto")
    name = key
  elif os.path.isfile(name_or_path):
    path, name = name_or_path, os.path.basename(name_or_path)
  else:
    raise TargetError(f"--target={name_or_path!r}: not one of {', '.join(NAMED_TARGETS)} "
                      "and not a GpuTargetConfig text-proto file")
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise TargetError(f"--target={name_or_path}: cannot read {path}: {e}") from None
  return parse_target(text, name)
