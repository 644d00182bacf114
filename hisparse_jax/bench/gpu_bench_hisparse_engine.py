"""`gpu_bench_hisparse`'s engine part: an 8B-class random model served by the engine.

The model (Llama-3.1-8B's shapes at full size, models/random_weights.py: weights drawn on
the device, nothing downloaded) serves, greedy, `ignore_eos`, prefix caching off, blocks of
16 tokens, one prompt chunk size for D, H and W (few chunk shapes: few 32-layer
compiles), from random token ids:

    D  device-only: a device KV budget of N requests of `request_tokens` (prompt + new
       tokens; a spare block each, the null block), no HiSparse
    H  HiSparse, admission "offload", the same device blocks (+ what HiSparse reserves
       beside them), a host pool of every request; top-k = hot buffer
    W  the same, admission "wait": the host pool backs decoders, no admission by offload
    X  HiSparse on a device pool of half a request, chunks of its own; top-k = hot
       buffer as large as that pool leaves beside a chunk (+ 2 blocks)

Runs, in this order (each skipped, saying so, when the time left cannot hold it):

    (b) batch 1: one request on D, then the same request on H: decode tokens/s H / D
        (target >= 0.95)
    (c) the same prompt on X (twice its device pool: streamed through the host pool, its
        chunks exact over every earlier block): its tokens against D's; the first token
        comes from the exact streamed prefill alone and MUST be equal (a correctness
        failure otherwise); the later ones decode over the top-k X's device allows (a hot
        buffer must hold the top-k, so no top-k covers every block of a request twice the
        pool), compared and reported
    (a) 4N requests on D, H and W: decode tokens/s of each, H / D (target >= 2)

Each engine is built once (a row gives its seconds: on a GPU `Engine` compiles its largest
prefill and decode steps at load for aot.check_step_footprint, 32-layer compiles), D and
H kept from (b) to (a); the estimate that skips a run is D's first request's seconds per
prompt, plus D's build time for an engine not built yet.

Decode tokens/s (peer_worker.py's decode-only steps): the `step()` calls whose engine step
and the one before it scheduled no prompt token, and that compiled no new step shape (no
untimed warm-up call: a 32k prefill is the dearest thing here); the figure is the median
over those calls of tokens / seconds (a first run's one-off costs, e.g. building the CPU
kernels, left out), their mean rate beside it (`decode_tokens_per_s_mean`).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time

import numpy as np

GIB = 2**30
TARGET_BATCH1 = 0.95
TARGET_THROUGHPUT = 2.0


@dataclasses.dataclass(frozen=True)
class EngineSize:
  model: str  # "8b": Llama-3.1-8B's shapes; "tiny": a 2-layer toy (CPU smoke)
  dtype: str
  request_tokens: int  # prompt + new tokens of every request (= max_model_len)
  num_device_requests: int  # N: the device budget's requests
  new_tokens: int  # (a) and (b)
  check_tokens: int  # (c)
  top_k_tokens: int
  chunk_tokens: int  # max_num_batched_tokens of D, H and W
  x_chunk_tokens: int  # X's (its hot buffer is what its pool leaves beside a chunk)
  block_size: int = 16

  @property
  def prompt_tokens(self) -> int:
    return self.request_tokens - self.new_tokens


SIZES = {
    # N = 1: a 32k request holds 4 GiB of bf16 KV (128 KiB a token); 4 requests of 32k.
    # Chunks of 16k tokens: a prompt prefills in 2 steps of 2 table widths (1,024 and
    # 2,048 blocks), so D and H compile 2 prefill programs each, not 6 (chunks of 2k);
    # an offloaded H request streams through 128 + 1,024 + 2 of its 2,049 device blocks.
    "full": EngineSize(model="8b", dtype="bfloat16", request_tokens=32768,
                       num_device_requests=1, new_tokens=64, check_tokens=4,
                       top_k_tokens=2048, chunk_tokens=16384, x_chunk_tokens=4096),
    "smoke": EngineSize(model="tiny", dtype="float32", request_tokens=256,
                        num_device_requests=1, new_tokens=32, check_tokens=4,
                        top_k_tokens=64, chunk_tokens=64, x_chunk_tokens=32),
}


def tiny_config():
  from models.config import ModelConfig  # noqa: PLC0415

  return ModelConfig(model_type="llama", vocab_size=256, hidden_size=64,
                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)


def build_model(size: EngineSize):
  """(model, seconds): random weights drawn on the device."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from models.random_weights import llama_8b_config, random_llama  # noqa: PLC0415

  start = time.perf_counter()
  config = llama_8b_config() if size.model == "8b" else tiny_config()
  model = random_llama(config, jnp.dtype(size.dtype), seed=0)
  jax.block_until_ready(model.embed_tokens[...])
  return model, time.perf_counter() - start


def _hisparse(size: EngineSize, admission: str = "offload", top_k: int | None = None):
  from hisparse_jax.sparse.config import HiSparseConfig  # noqa: PLC0415

  top_k = size.top_k_tokens if top_k is None else top_k
  return HiSparseConfig(top_k_tokens=top_k, hot_buffer_tokens=top_k, admission=admission)


def engine_configs(size: EngineSize, spec) -> dict:
  """Each engine's EngineConfig and planned device blocks (module doc)."""
  from hisparse_jax.engine.config import EngineConfig  # noqa: PLC0415
  from hisparse_jax.engine.planning import hisparse_capacity_for  # noqa: PLC0415

  bs = size.block_size
  request_blocks = math.ceil(size.request_tokens / bs)
  requests = 4 * size.num_device_requests
  base = dict(dtype=size.dtype, block_size=bs, max_model_len=size.request_tokens,
              max_num_seqs=requests, max_num_batched_tokens=size.chunk_tokens,
              enable_prefix_caching=False)

  def gib(blocks: int, reserved: int = 0) -> float:
    return (blocks * spec.bytes_per_block + reserved + 512) / GIB

  device_blocks = size.num_device_requests * (request_blocks + 1) + 1
  host_blocks = (requests + 2) * request_blocks + 1
  out = {"D": (EngineConfig(**base, device_kv_gib=gib(device_blocks),
                            host_pool_gib=gib(request_blocks + 2)), device_blocks)}
  for name, admission in (("H", "offload"), ("W", "wait")):
    config = EngineConfig(**base, hisparse=_hisparse(size, admission),
                          host_pool_gib=gib(host_blocks))
    reserved = hisparse_capacity_for(config, spec, device_blocks, host_blocks).reserved_bytes
    out[name] = (dataclasses.replace(config, device_kv_gib=gib(device_blocks, reserved)),
                 device_blocks)
  # X: half a request's blocks usable; top-k = hot buffer = what streaming leaves of them.
  usable = math.ceil(request_blocks / 2)
  top_k = (usable - math.ceil(size.x_chunk_tokens / bs) - 2) * bs
  config = EngineConfig(**{**base, "max_num_seqs": 2, "max_num_batched_tokens":
                           size.x_chunk_tokens}, hisparse=_hisparse(size, top_k=top_k),
                        host_pool_gib=gib(2 * request_blocks + 2))
  reserved = hisparse_capacity_for(config, spec, usable + 1, 2 * request_blocks + 2
                                   ).reserved_bytes
  out["X"] = (dataclasses.replace(config, device_kv_gib=gib(usable + 1, reserved)), usable + 1)
  return out


def drive(engine, prompts: list[list[int]], max_tokens: int, deadline: float) -> dict:
  """Adds every prompt, steps to the end (or to `deadline`: the rest aborted); the decode
  measure of the module doc, the tokens, and the call's HiSparse counters."""
  from hisparse_jax.engine.sampling import RequestOutputKind, SamplingParams  # noqa: PLC0415

  def counters():
    return {k: v for k, v in engine.metrics().items() if "_total" in k}

  before = counters()
  params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA)
  ids = [engine.add_request(prompt_token_ids=p, sampling_params=params) for p in prompts]
  tokens = {rid: [] for rid in ids}
  start = time.perf_counter()
  decode_s, decode_tokens, decode_steps, compile_steps = 0.0, 0, 0, 0
  step_rates = []  # tokens / seconds of each decode-only step
  previous, max_decoding, timed_out = None, 0, False
  while engine.has_unfinished_requests():
    if time.monotonic() > deadline:
      timed_out = True
      for rid in ids:
        engine.abort_request(rid)
      for _ in range(8):
        engine.step()
      break
    shapes = len(engine.runner.shapes_compiled)
    before_step = time.perf_counter()
    outs = engine.step()
    seconds = time.perf_counter() - before_step
    compiled = len(engine.runner.shapes_compiled) != shapes
    compile_steps += compiled
    max_decoding = max(max_decoding, sum(not r.is_prefilling for r in engine.scheduler.running))
    new = 0
    for out in outs:
      if out.request_id in tokens:
        tokens[out.request_id].extend(out.outputs[0].token_ids)
        new += len(out.outputs[0].token_ids)
    prefill = engine.last_step_prefill_tokens
    if prefill == 0 and previous == 0 and not compiled:
      decode_s += seconds
      decode_tokens += new
      decode_steps += 1
      step_rates.append(new / seconds)
    previous = prefill
  after = counters()
  diff = {k: v - before.get(k, 0.0) for k, v in after.items()}
  return {"seconds": time.perf_counter() - start, "timed_out": timed_out,
          "token_ids": [tokens[rid] for rid in ids],
          "decode_tokens_per_s": float(np.median(step_rates)) if step_rates else None,
          "decode_tokens_per_s_mean": decode_tokens / decode_s if decode_s else None,
          "decode_steps": decode_steps, "decode_tokens": decode_tokens,
          "steps_that_compiled": compile_steps, "max_decoding": max_decoding,
          "offloads": diff.get("hisparse_offloads_total", 0.0),
          "host_blocks_selected": diff.get('hisparse_blocks_selected_total{source="host"}',
                                           0.0),
          "host_loads": diff.get("hisparse_hot_buffer_loads_total", 0.0)}


def compare_tokens(have: list[int], want: list[int]) -> tuple[int, bool]:
  """(leading tokens of `have` equal to `want`'s, whether the first one is: what (c)
  requires). Outputs of different lengths count only their common part; an empty one
  never passes."""
  equal = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b),
               min(len(have), len(want)))
  return equal, bool(have) and bool(want) and have[0] == want[0]


class _Part:
  """The engine part's rows, skips, and clock (shared with the CLI's)."""

  def __init__(self, clock, add_row, skip):
    self.clock, self.add_row, self.skip = clock, add_row, skip
    self.seconds_per_prompt = None  # wall of D's first request: the estimate's unit
    self.build_s = 0.0  # D's build: what an engine not built yet adds
    self.correct = True

  def fits(self, what: str, prompts: int, built: bool = True) -> bool:
    left = self.clock.left()
    if self.seconds_per_prompt is not None:
      need = prompts * self.seconds_per_prompt + (0.0 if built else self.build_s)
      if need > left:
        self.skip("engine", what, f"budget: ~{need:.0f} s estimated ({prompts} prompts x "
                  f"{self.seconds_per_prompt:.0f} s, D's first request"
                  f"{'' if built else f', + {self.build_s:.0f} s to build an engine'}), "
                  f"{left:.0f} s left")
        return False
    elif left <= 0:
      self.skip("engine", what, "budget: no time left")
      return False
    return True

  def run(self, engine, name: str, what: str, prompts, max_tokens: int):
    result = drive(engine, prompts, max_tokens, self.clock.deadline)
    if result["timed_out"]:
      self.skip("engine", what, f"budget: ran out after {result['seconds']:.0f} s in "
                f"{name}'s run (aborted; its figures are not recorded)")
      return None
    return result


def _info(engine, planned: int) -> dict:
  c = engine.config
  hs = c.hisparse
  return {"device_blocks": engine.device_pool.num_blocks, "planned_device_blocks": planned,
          "host_blocks": engine.host_pool.num_blocks, "device_kv_gib": c.device_kv_gib,
          "max_num_batched_tokens": c.max_num_batched_tokens,
          "hisparse": None if hs is None else {
              "top_k_tokens": hs.top_k_tokens, "hot_buffer_tokens": hs.hot_buffer_tokens,
              "admission": hs.admission, "sparse_threshold_tokens": hs.sparse_threshold_tokens}}


def run(size_name: str, clock, add_row, skip) -> None:
  """The engine part (module doc): rows through `add_row(part, name, config, figure, unit,
  target, met, **details)`, skips through `skip(part, what, reason)`; returns whether
  every required token equality held."""
  from hisparse_jax.engine.engine import Engine  # noqa: PLC0415
  from hisparse_jax.kv_cache.kv_pool import KVCacheSpec  # noqa: PLC0415
  from kernels_pallas import backend  # noqa: PLC0415

  size = SIZES[size_name]
  on_gpu = backend.platform() == "gpu"
  part = _Part(clock, add_row, skip)
  model, build_s = build_model(size)
  add_row("engine", "random model built on the device", {"model": size.model,
          "dtype": size.dtype, "params": model.config.num_params()}, build_s, "s", None, None)
  spec = KVCacheSpec.from_model_config(model.config, size.dtype, size.block_size)
  configs = engine_configs(size, spec)
  rng = np.random.default_rng(55)
  vocab = model.config.vocab_size
  prompt = lambda: rng.integers(0, vocab, size.prompt_tokens).tolist()  # noqa: E731
  common = {"request_tokens": size.request_tokens, "prompt_tokens": size.prompt_tokens,
            "block_size": size.block_size, "chunk_tokens": size.chunk_tokens,
            "kv_bytes_per_token": spec.bytes_per_token}
  engines: dict[str, object] = {}

  def engine(name):
    if name not in engines:
      config, planned = configs[name]
      start = time.perf_counter()
      engines[name] = Engine(config, model=model, model_config=model.config)
      seconds = time.perf_counter() - start
      part.build_s = max(part.build_s, seconds)
      add_row("engine", f"engine {name} built (on a GPU: its largest steps compiled for "
              "aot.check_step_footprint)", _info(engines[name], planned), seconds, "s",
              None, None)
    return engines[name]

  def drop(name):
    engines.pop(name, None)
    gc.collect()

  met = lambda ratio, target: None if not on_gpu else bool(ratio >= target)  # noqa: E731
  # (b) batch 1, and D's tokens: (c)'s reference.
  first = prompt()
  dense = part.run(engine("D"), "D", "(b) batch 1, device-only", [first], size.new_tokens)
  if dense is None:
    return part.correct
  part.seconds_per_prompt = dense["seconds"]
  sparse = None
  if part.fits("(b) batch 1, HiSparse", 1, built=False):
    sparse = part.run(engine("H"), "H", "(b) batch 1, HiSparse", [first], size.new_tokens)
  if sparse is not None and dense["decode_tokens_per_s"] and sparse["decode_tokens_per_s"]:
    ratio = sparse["decode_tokens_per_s"] / dense["decode_tokens_per_s"]
    add_row("engine", "(b) batch 1: HiSparse / dense decode tokens/s",
            {**common, "D": _info(engine("D"), configs["D"][1]),
             "H": _info(engine("H"), configs["H"][1])}, ratio, "x",
            f">= {TARGET_BATCH1}", met(ratio, TARGET_BATCH1),
            dense=_summary(dense), hisparse=_summary(sparse))
  # (c) a request of twice X's device pool.
  if part.fits("(c) 2x the device pool vs dense", 1, built=False):
    got = part.run(engine("X"), "X", "(c) 2x the device pool vs dense", [first],
                   size.check_tokens)
    if got is not None:
      want = dense["token_ids"][0][:size.check_tokens]
      have = got["token_ids"][0]
      equal, first_ok = compare_tokens(have, want)
      part.correct = part.correct and first_ok
      x = engine("X")
      usable = x.device_pool.num_blocks - 1
      add_row("engine", "(c) 2x the device pool: leading tokens equal to dense",
              {**common, "X": _info(x, configs["X"][1]),
               "request_over_device_pool": size.request_tokens / (usable * size.block_size),
               "top_k_over_request": x.config.hisparse.top_k_tokens / size.request_tokens},
              equal, f"of {len(want)} tokens", "first token equal (required)", first_ok,
              hisparse_tokens=have, dense_tokens=want, offloads=got["offloads"],
              host_loads=got["host_loads"])
      drop("X")
  # (a) 4N requests at N requests' device budget.
  prompts = [first] + [prompt() for _ in range(4 * size.num_device_requests - 1)]
  rates = {}
  for name, label in (("D", "device-only"), ("H", "HiSparse offload"),
                      ("W", "HiSparse wait (host pool only)")):
    what = f"(a) {len(prompts)} requests, {label}"
    if not part.fits(what, len(prompts), built=name in engines):
      continue
    result = part.run(engine(name), name, what, prompts, size.new_tokens)
    if result is None:
      continue
    rates[name] = result["decode_tokens_per_s"]
    add_row("engine", f"(a) {label}: decode tokens/s",
            {**common, "requests": len(prompts), "device_requests": size.num_device_requests,
             name: _info(engine(name), configs[name][1])},
            rates[name], "tokens/s", None, None, **_summary(result))
    drop(name)
  if rates.get("D") and rates.get("H"):
    ratio = rates["H"] / rates["D"]
    add_row("engine", "(a) HiSparse offload / device-only decode tokens/s",
            {**common, "requests": len(prompts)}, ratio, "x", f">= {TARGET_THROUGHPUT}",
            met(ratio, TARGET_THROUGHPUT))
  if rates.get("D") and rates.get("W"):
    add_row("engine", "(a) HiSparse wait / device-only decode tokens/s",
            {**common, "requests": len(prompts)}, rates["W"] / rates["D"], "x", None, None)
  engines.clear()
  gc.collect()
  return part.correct


def _summary(result: dict) -> dict:
  return {k: v for k, v in result.items() if k != "token_ids"}
