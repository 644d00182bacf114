"""`hisparse-jax bench`: the benchmark suites, each a table on stdout and a JSON section.

Usage::

  hisparse-jax bench [--suite=NAME|all] [--out=FILE.json]
      [--bench_size=full|smoke|streamed|8k_b32|8k_b32_int8|sweep|workload|long|long_6k|long_2k_8k]
      [--bench_plot=FILE.png]
      [--block_size=16 (decode_sparse_vs_dense)]

Suites (`hisparse_jax/bench/<module>.py`, each `run(size_name) -> dict` and
`format_table(dict) -> str`):

  transfer                TransferEngine h2d / d2h vs a numpy copy of the same bytes
  decode_sparse_vs_dense  engine decode step, HiSparse top-k vs dense, 4k-64k context
  capacity_concurrency    requests at once and tokens/s at one device budget
  engine_vs_hf            greedy batch generation vs transformers and a plain JAX loop
  engine_vs_vllm          tokens/s vs vLLM's CPU build (its venv: `make peers`), 3 workloads
  scheduler_overhead      host microseconds per decode step per sequence
  kernel                  Pallas kernels vs their jnp references (kernels_pallas.bench)

Accuracy suites (run only by name, not by `all`: about an hour on the 2-core CPU):

  passkey                 passkey retrieval on smollm2-135m-instruct, 1k-8k tokens, dense
                          vs HiSparse top-k 256-2,048 at blocks 16 / 32 (the answer from
                          sparse decode steps); --bench_plot: accuracy against length
  hisparse_throughput     decode and end-to-end tokens/s on smollm2-135m-instruct at one
                          device KV budget: device-only vs HiSparse vs vLLM, and a
                          concurrency sweep 1-32 (~1 h on 2 cores); --bench_plot: decode
                          tokens/s against requests at once. --bench_size=long: admission
                          by offload (#53), 8 passkey prompts at ~2k, ~6k and the model's
                          longest context over a device pool of 3, device-only vs HiSparse
                          admission "offload" vs "wait" (long_6k: the ~6k rows alone;
                          long_2k_8k: the others)
  cold_start              fresh `hisparse-jax generate` processes on the real model, dense
                          vs HiSparse, compilation cache off and warm (~20 min)
  dsa_decode              a DSA model's decode step (learned indexer, sparse MLA, host tier
                          in: offloaded, warm and cold hot buffer) vs dense MLA over the
                          full cache, 4k-64k context (~1 min)
  third_tier              TTFT of a repeated ~4k-token prompt from the disk tier after an
                          engine restart and from a shared Redis store by a second engine,
                          vs recomputing it; the load-vs-recompute gate on a throttled tier
  warm_restart            real `serve` processes restarted on one disk tier and compilation
                          cache: the first disk-tier hit after a restart (warm-up off, on,
                          on with its programs cached) vs the same hit on the warmed
                          server; time to "serving on"; recompute (~10 min)
  slow_clients            `serve`'s streams' inter-token latency alone and beside a slow
                          and a stalled client (aborted at --max_stream_buffer), rounds
                          alternated; pools empty afterwards (~1-3 min)

Every ratio is measured side by side in one run (the contenders interleaved); the JSON
names the machine (CPU, cores, accelerator, jax version, load average at the start and
the end). The JSON file is rewritten after each suite, so an interrupted `all` run
keeps the suites it finished.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time

from absl import flags

FLAGS = flags.FLAGS

# suite name -> module under hisparse_jax.bench; `all` runs them in this order.
SUITES = {
    "kernel": "kernel",
    "transfer": "transfer",
    "decode_sparse_vs_dense": "decode",
    "hisparse_hot_buffer": "hot_buffer",
    "capacity_concurrency": "capacity",
    "engine_vs_hf": "engine_vs_hf",
    "engine_vs_vllm": "engine_vs_vllm",
    "scheduler_overhead": "scheduler_overhead",
    "serve_load": "serve_load",
}
# Suites that `all` leaves out (accuracy yardsticks and throughput on a real model: long
# runs; DSA models' decode step, recorded apart from the `all` run); by name only.
ACCURACY_SUITES = {
    "passkey": "passkey",
    "hisparse_throughput": "hisparse_throughput",
    "cold_start": "cold_start",
    "dsa_decode": "dsa_decode",
    "third_tier": "third_tier",
    "warm_restart": "warm_restart",
    "slow_clients": "slow_clients",
}
# Suites whose module has plot(result, path), which --bench_plot draws.
PLOTTED = ("decode_sparse_vs_dense", "passkey", "hisparse_throughput")


def suite_names(suite: str) -> list[str]:
  """The suites `--suite` names, in run order; ValueError naming the flag otherwise."""
  if suite == "all":
    return list(SUITES)
  if suite not in SUITES and suite not in ACCURACY_SUITES:
    raise ValueError(f"--suite: unknown suite {suite!r}; choose all or one of: "
                     f"{', '.join([*SUITES, *ACCURACY_SUITES])}")
  return [suite]


def run_suites(names: list[str], size_name: str, block_size: int, out: str | None = None,
               plot_path: str | None = None, command: str | None = None) -> dict:
  """Runs the suites in turn, printing each table; returns (and writes) the JSON.

  `command`: the command line that ran them, recorded in the JSON.
  """
  from hisparse_jax.bench import common  # imports jax: on use

  result = {"command": command,
            "size": size_name, "machine": common.machine(), "seconds": {},
            "cpu_seconds": {}, "suites": {}}
  start = time.perf_counter()
  for name in names:
    module = importlib.import_module(
        f"hisparse_jax.bench.{SUITES.get(name) or ACCURACY_SUITES[name]}")
    print(f"== {name} ==", flush=True)
    t0, cpu0 = time.perf_counter(), time.process_time()
    kwargs = {"block_size": block_size} if name == "decode_sparse_vs_dense" else {}
    suite_result = module.run(size_name, **kwargs)
    result["seconds"][name] = time.perf_counter() - t0
    # CPU time of this process (all threads): what the suite cost, whatever the load.
    result["cpu_seconds"][name] = time.process_time() - cpu0
    result["suites"][name] = suite_result
    print(module.format_table(suite_result), flush=True)
    print(f"({name}: {result['seconds'][name]:.1f} s, {result['cpu_seconds'][name]:.1f} s "
          "CPU)\n", flush=True)
    if name in PLOTTED and plot_path:
      _makedirs_for(plot_path)
      module.plot(suite_result, plot_path)
      print(f"wrote {plot_path}")
    result["seconds"]["total"] = time.perf_counter() - start
    result["load_avg_end_1_5_15"] = list(os.getloadavg())
    if out:
      _write_json(result, out)
  if out:
    print(f"wrote {out} ({result['seconds']['total']:.1f} s in all)")
  return result


def _makedirs_for(path: str) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)


def _write_json(result: dict, path: str) -> None:
  _makedirs_for(path)
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(result, f, indent=1)
    f.write("\n")
  os.replace(tmp, path)


def main(argv: list[str]) -> int:
  del argv  # all input comes from the flags of hisparse_jax.entrypoints.cli.flag_defs
  names = suite_names(FLAGS.suite)
  for name in names:  # (full and smoke: every suite's; others: a suite's own)
    module = importlib.import_module(
        f"hisparse_jax.bench.{SUITES.get(name) or ACCURACY_SUITES[name]}")
    sizes = getattr(module, "SIZES", None)
    if FLAGS.bench_size not in ("full", "smoke") and (sizes is None
                                                      or FLAGS.bench_size not in sizes):
      raise ValueError(f"--bench_size={FLAGS.bench_size}: the {name} suite has no such size")
  plotted = [n for n in names if n in PLOTTED]
  if FLAGS.bench_plot and not plotted:
    raise ValueError(f"--bench_plot: the plot comes from the {', '.join(PLOTTED)} suites, "
                     f"none of which --suite={FLAGS.suite} runs")
  # --block_size sizes the HiSparse suite (decode_sparse_vs_dense); unset, HiSparse's
  # default block size.
  block_size = FLAGS.block_size if FLAGS.block_size is not None else 16
  if block_size <= 0 or block_size & (block_size - 1):
    raise ValueError(f"--block_size must be a power of two, got {block_size}")
  run_suites(names, FLAGS.bench_size, block_size, FLAGS.out, FLAGS.bench_plot,
             command=" ".join(["hisparse-jax", *sys.argv[1:]]))
  return 0
