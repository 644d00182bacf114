"""`hisparse-jax compile --target=h200`: every program the engine builds for these flags,
compiled for a GPU by XLA's GPU compiler, on a machine without one.

Usage::

  hisparse-jax compile [--target=h200|h100|a100|FILE] [--model=...] [--dtype=bfloat16]
      [--kv_cache_dtype=int8] [--hisparse ...] [--tensor_parallel_size=N]
      [--kernel_backend=pallas_mgpu] [--programs=decode,tiered_decode] [--out=FILE]

Builds the engine's programs at the shapes it would build on that GPU (the capacity plan
its memory gives, the largest step of each kind; hisparse_jax/engine/aot.py) and compiles
each one (Triton / Mosaic GPU kernels, XLA's host offloader, PTX). Prints one row per
program (compile seconds, the compiled program's device bytes: arguments, outputs,
temporaries; its host <-> device copies; its Pallas kernels) and writes the JSON report.

Exit status: 0 when every program compiled and the largest one's temporaries fit beside
the weights and the KV pools; 2 with one line naming the cause when the config cannot run
there (fp8 KV below sm_89, temporaries over the device budget's reserve, a bad flag); 1
naming the program and XLA's first error line when a program fails to compile.
"""

from __future__ import annotations

import json
import os
import sys

from absl import flags

FLAGS = flags.FLAGS


def _prepare_jax() -> None:
  """This host's CPU lowers the programs (they are compiled for the target, never run
  here): JAX on CPU, with as many CPU devices as --tensor_parallel_size needs (set before
  jax starts its backends)."""
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # (XLA's C++ warnings per program)
  import logging  # noqa: PLC0415

  logging.getLogger("jax._src.compiler").setLevel(logging.WARNING)
  tp = FLAGS.tensor_parallel_size
  if tp > 1:
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join([*kept, f"--xla_force_host_platform_device_count={tp}"])


def main(argv: list[str]) -> int:
  del argv
  _prepare_jax()
  from hisparse_jax.engine.gpu_target import load_target  # noqa: PLC0415

  target = load_target(FLAGS.target)  # (a bad --target: one line before any model work)
  from hisparse_jax.engine.config import EngineConfig  # noqa: PLC0415
  from hisparse_jax.entrypoints.cli.generate import hisparse_from_flags, tier_kwargs_from_flags

  kwargs = dict(model=FLAGS.model, dtype=FLAGS.dtype, kv_cache_dtype=FLAGS.kv_cache_dtype,
                index_cache_dtype=FLAGS.index_cache_dtype,
                block_size=FLAGS.block_size, device_kv_gib=FLAGS.device_kv_gib,
                host_pool_gib=FLAGS.host_pool_gib, max_model_len=FLAGS.max_model_len,
                max_num_seqs=FLAGS.max_num_seqs,
                max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                hisparse=hisparse_from_flags(), tensor_parallel_size=FLAGS.tensor_parallel_size,
                kernel_backend=(None if FLAGS.kernel_backend in (None, "auto")
                                else FLAGS.kernel_backend),
                **tier_kwargs_from_flags())
  try:
    config = EngineConfig(**kwargs)
  except ValueError as e:
    raise ValueError(f"--{e}") from None
  from hisparse_jax.engine import aot, aot_compile  # noqa: PLC0415 (imports jax)

  build = aot.AotBuild(config, target)
  names = {p.name for p in build.programs()}
  only = set(FLAGS.programs) or None
  if only is not None and only - names:
    raise ValueError(f"--programs: {', '.join(sorted(only - names))} is not a program of "
                     f"this config (it builds {', '.join(sorted(names))})")
  for line in build.describe():
    print(line, flush=True)
  report = aot_compile.compile_programs(build, only)
  print(report.table(), flush=True)
  out = FLAGS.out or f"compile_{target.name.replace('.textproto', '')}.json"
  with open(out, "w", encoding="utf-8") as f:
    json.dump(report.to_json(), f, indent=2, default=str)
  print(f"wrote {out}")
  if report.failed:
    first = report.failed[0]
    print(f"hisparse-jax compile: error: program {first.name!r} failed to compile for "
          f"{target.device_kind}: {first.error}", file=sys.stderr)
    return 1
  report.check_footprint()  # ValueError: one line, exit 2
  return 0
