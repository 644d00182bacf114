"""Suite `kernel`: each Pallas kernel against its jitted jnp reference (kernels_pallas.bench).

This suite is `kernels_pallas.bench.run` (its table, its JSON rows) plus one summary per
kernel: `pallas_over_reference` = Pallas median time / reference median time; the int8
rows also `pallas_over_float_cache` (the int8 cache's time / the float cache's, same
kernel: on a GPU, what reading ~1/3.6 of the bytes buys). On CPU the
Pallas column is interpret mode (a correctness path, not a speed path: the engine runs the
references there); on a GPU it is the compiled kernel, and `hbm_fraction` is the share of
the device's HBM bandwidth it reaches.
"""

from __future__ import annotations

from kernels_pallas import bench as kernel_bench

# bench size name -> (kernels_pallas.bench size, repetitions); None: small on CPU, large on GPU.
SIZES = {"full": (None, 5), "smoke": ("small", 1)}


def run(size_name: str = "full") -> dict:
  size, reps = SIZES[size_name]
  result = kernel_bench.run(size, reps)
  by_kernel: dict[str, dict] = {}
  for row in result["rows"]:
    by_kernel.setdefault(row["kernel"], {})[row["impl"]] = row
  summary = {}
  for kernel, impls in by_kernel.items():
    pallas = next(r for impl, r in impls.items() if impl.startswith("pallas"))
    reference = impls["xla-reference"]
    summary[kernel] = {"pallas_impl": pallas["impl"],
                       "pallas_over_reference": pallas["median_ms"] / reference["median_ms"],
                       "hbm_fraction": pallas["hbm_fraction"]}
    base = kernel.removesuffix(" int8")
    if base != kernel:  # the 8-bit cache against the float one, same kernel and shapes
      summary[kernel]["pallas_over_float_cache"] = (
          pallas["median_ms"] / next(r for impl, r in by_kernel[base].items()
                                     if impl.startswith("pallas"))["median_ms"])
  result["summary"] = summary
  return result


def format_table(result: dict) -> str:
  return kernel_bench.format_table(result)
