"""Compiling an AotBuild's programs for its GPU target (hisparse_jax/engine/aot.py builds
them): each lowered for "cuda" from this host's shardings (memory kinds kept) inside the
target's abstract mesh (Pallas builds its Triton / Mosaic GPU kernels for it), then compiled
by XLA's GPU compiler through the target topology's compile-only client, never loaded.
AotReport holds the verdicts: memory_analysis() per program, the host copies in the
compiled HLO, the Pallas kernels, XLA's first error line; the table, the JSON, and the
footprint check (a program's temporaries against what the plan leaves beside weights and
pools).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import re
import time

import jax
import numpy as np

from hisparse_jax.engine.aot import AotBuild, Program, gib_text
from hisparse_jax.engine.gpu_target import GpuTarget


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
  """One program's verdict from XLA's GPU compiler (bytes per device)."""

  name: str
  kind: str
  detail: str
  seconds: float
  argument_bytes: int = 0
  output_bytes: int = 0
  alias_bytes: int = 0  # outputs written into donated arguments (the pools, in place)
  temp_bytes: int = 0
  host_bytes: int = 0  # pinned_host arguments (the host pool)
  host_copies: int = 0  # host <-> device copies in the compiled program (copy-start ops)
  kernels: tuple[str, ...] = ()  # the Pallas kernels it calls (Triton / Mosaic GPU)
  # host -> device copies with kernels scheduled between their start and done
  # (`overlapped_copies`)
  overlapped: tuple[tuple[str, tuple[str, ...]], ...] = ()
  error: str | None = None  # XLA's first error line; None: compiled

  @property
  def new_bytes(self) -> int:
    """Device bytes the program allocates beyond its arguments: temporaries and the
    outputs not written into donated arguments."""
    return self.temp_bytes + max(0, self.output_bytes - self.alias_bytes)


def _first_error_line(e: Exception) -> str:
  lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
  for ln in lines:  # XLA's own message, past jax's preamble
    if re.search(r"INTERNAL|INVALID_ARGUMENT|UNIMPLEMENTED|RESOURCE_EXHAUSTED|E\d{4}", ln):
      return ln[:400]
  return (lines[0] if lines else type(e).__name__)[:400]


def _kernels(lowered_text: str) -> tuple[str, ...]:
  """The Pallas kernels a lowered program calls: Triton kernels by name, Mosaic GPU ones
  by the function holding their call."""
  names = set()
  for line in lowered_text.splitlines():
    if "xla.gpu.triton" in line:
      names.update(re.findall(r'\bname = "(\w+)"', line))
  # (`func.call` inside a conditional's branch)
  calls = re.findall(r"= (?:func\.)?call @(\w+_mgpu)\(", lowered_text)
  names |= {f"{m} (mosaic_gpu)" for m in calls}
  if "mosaic_gpu" in lowered_text and not any("mosaic" in n for n in names):
    names.add("(mosaic_gpu)")
  return tuple(sorted(names))


def overlapped_copies(hlo_text: str) -> list[tuple[str, tuple[str, ...]]]:
  """The host -> device copies of a compiled program's entry computation whose
  copy-start and copy-done have kernels scheduled between them (the copy runs while they
  do: what XLA's latency-hiding scheduler gives): [(copy-start name, (the Pallas
  kernels between, by the function that called pallas_call))] in schedule order. A copy
  counts when its source is in host memory (the S(5) memory space), its result on the
  device."""
  entry = hlo_text[hlo_text.index("\nENTRY"):].split("\n}\n")[0]
  open_copies: dict[str, list[str]] = {}
  found = []
  for line in entry.splitlines():
    m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)", line)
    if not m:
      continue
    name, rest = m.groups()
    start = re.match(r"\((\S+), (\S+), u32\[\]\) copy-start\(", rest)
    if start and ":S(5)}" in start.group(2) and ":S(" not in start.group(1):
      open_copies[name] = []
      continue
    done = re.search(r"copy-done\(%([\w.\-]+)\)", rest)
    if done and done.group(1) in open_copies:
      kernels = open_copies.pop(done.group(1))
      if kernels:
        found.append((done.group(1), tuple(kernels)))
      continue
    if "custom_call_target=\"__gpu$xla.gpu.triton\"" in rest or "mosaic_gpu" in rest:
      # (Triton kernels come from pallas_call, Mosaic GPU ones from an mpmd_map)
      kernel = re.search(r'op_name="[^"]*?/(\w+)/(?:pallas_call|mpmd_map)"', rest)
      for kernels in open_copies.values():
        kernels.append(kernel.group(1) if kernel else name)
  return found


def _compile_for_target(build: AotBuild, lowered):
  """XLA's GPU compiler over the lowered module, for the target's devices (the topology's
  compile-only client): the executable, never loaded."""
  from jax._src import compiler  # noqa: PLC0415 (compile options: no public API yet)
  from jax._src.lib import xla_client as xc  # noqa: PLC0415

  n = len(build.target_devices)
  # The program's own XLA options (jax.jit(compiler_options=): the overlapped loads' step
  # asks for the latency-hiding scheduler), as jax's compile would pass them.
  overrides = dict(getattr(getattr(lowered, "_lowering", None), "_compiler_options_kvs", ()))
  options = compiler.get_compile_options(num_replicas=1, num_partitions=n,
                                         device_assignment=np.arange(n).reshape(1, n),
                                         env_options_overrides=overrides or None)
  if n > 1:  # (as jax's own compile of a program over a mesh)
    options.executable_build_options.use_spmd_partitioning = True
    options.executable_build_options.use_shardy_partitioner = bool(
        jax.config.jax_use_shardy_partitioner)
  client = build.target_devices[0].client
  return client.compile(lowered.compiler_ir("stablehlo"),
                        executable_devices=xc.DeviceList(tuple(build.target_devices)),
                        compile_options=options)


def compile_program(build: AotBuild, program: Program) -> CompiledProgram:
  """`program` lowered for "cuda" (from this host's shardings: memory kinds kept) and
  compiled for the target; Pallas lowers inside the target's abstract mesh."""
  t = time.perf_counter()
  # The abstract mesh Pallas builds its GPU kernels for: the target's one device, or the
  # topology mesh of a tensor-parallel step (the block moves over this host's mesh call
  # no kernel).
  if build.mesh is None:
    context = build.target.kernel_context()
  elif program.kind == "step":
    context = jax.sharding.use_abstract_mesh(build.mesh.abstract_mesh)
  else:
    context = contextlib.nullcontext()
  try:
    with context:
      lowered = program.fn.trace(*program.args, **program.kwargs).lower(
          lowering_platforms=("cuda",))
    kernels = _kernels(lowered.as_text())
    executable = _compile_for_target(build, lowered)
  except Exception as e:  # XLA reports compile errors as several exception types
    return CompiledProgram(program.name, program.kind, program.detail,
                           time.perf_counter() - t, error=_first_error_line(e))
  seconds = time.perf_counter() - t
  ma = executable.get_compiled_memory_stats()
  text = "\n".join(m.to_string() for m in executable.hlo_modules())
  return CompiledProgram(
      program.name, program.kind, program.detail, seconds,
      argument_bytes=int(ma.argument_size_in_bytes),
      output_bytes=int(ma.output_size_in_bytes),
      alias_bytes=int(ma.alias_size_in_bytes),
      temp_bytes=int(ma.temp_size_in_bytes),
      host_bytes=int(ma.host_argument_size_in_bytes),
      host_copies=len(re.findall(r"\bcopy-start\(", text)),
      kernels=kernels, overlapped=tuple(overlapped_copies(text)))


@dataclasses.dataclass(frozen=True)
class AotReport:
  """Every program of a build, compiled (or not) for its target."""

  target: GpuTarget
  build: AotBuild
  programs: tuple[CompiledProgram, ...]

  @property
  def failed(self) -> tuple[CompiledProgram, ...]:
    return tuple(p for p in self.programs if p.error is not None)

  def largest(self) -> CompiledProgram:
    return max((p for p in self.programs if p.error is None), key=lambda p: p.new_bytes)

  def check_footprint(self) -> None:
    """ValueError naming the program and the flags when the largest program's new device
    bytes exceed what the plan leaves beside the weights and the KV budget."""
    if not any(p.error is None for p in self.programs):
      return
    b, p = self.build, self.largest()
    if p.new_bytes <= b.reserve_bytes:
      return
    source = ("--device_kv_gib" if b.config.device_kv_gib is not None else
              f"the default budget ({b.plan.device_budget_source})")
    raise ValueError(
        f"the compiled program {p.name!r} needs {gib_text(p.new_bytes)} of device temporaries, "
        f"but {source} leaves {gib_text(max(0, b.reserve_bytes))} beside the weights "
        f"({gib_text(b.weight_bytes)}) and the KV budget ({gib_text(b.kv_bytes)}) in the "
        f"{b.target.device_kind}'s {gib_text(b.target.bytes_limit())} usable: lower "
        "--device_kv_gib or --max_num_batched_tokens / --max_num_seqs")

  def to_json(self) -> dict:
    b = self.build
    return {
        "target": {"name": self.target.name, "device_kind": self.target.device_kind,
                   "compute_capability": "{}.{}".format(*self.target.compute_capability),
                   "memory_bytes": self.target.memory_bytes,
                   "bytes_limit": self.target.bytes_limit()},
        "jax": jax.__version__,
        # deviceless: XLA's GPU compiler on this host; nothing here ran on the target
        "compiled_on": {"host": platform.node(), "processor": platform.machine(),
                        "cpus": os.cpu_count(), "gpu": None},
        "config": {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v)
                   for k, v in dataclasses.asdict(b.config).items()},
        "kernel_backend": b.backend,
        "memory_per_device": {"weights": b.weight_bytes, "kv_budget": b.kv_bytes,
                              "reserve": b.reserve_bytes,
                              "device_blocks": b.plan.num_device_blocks,
                              "host_blocks": b.plan.num_host_blocks},
        "programs": [dataclasses.asdict(p) for p in self.programs],
    }

  def table(self) -> str:
    head = ("program", "kind", "compile s", "args", "outputs", "temps", "host copies",
            "kernels")
    rows = [head]
    for p in self.programs:
      if p.error is not None:
        rows.append((p.name, p.kind, f"{p.seconds:.1f}", "FAILED", "", "", "", p.error[:60]))
        continue
      rows.append((p.name, p.kind, f"{p.seconds:.1f}", gib_text(p.argument_bytes),
                   gib_text(p.output_bytes - p.alias_bytes), gib_text(p.temp_bytes),
                   str(p.host_copies), ",".join(p.kernels) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def compile_programs(build: AotBuild, only: set[str] | None = None,
                     on_program=None) -> AotReport:
  """Compiles every program of `build` (or those named in `only`); `on_program(result)`
  after each (progress)."""
  results = []
  for program in build.programs():
    if only is not None and program.name not in only:
      continue
    result = compile_program(build, program)
    results.append(result)
    if on_program is not None:
      on_program(result)
  return AotReport(build.target, build, tuple(results))
