"""One tensor-parallel case in a process of its own (4 virtual CPU devices): the engine at
tensor_parallel_size 1, 2 and 4 on the same prompts; prints one JSON object (tokens,
HiSparse counters, capacity figures and the live shard bytes measured beside them).

    python tests/hisparse_jax/distributed/tp_worker.py CASE [CHECKPOINT_DIR]

CASE: default_dense | default_hisparse | gqa_dense | gqa_hisparse. tests/conftest.py keeps
the suite's own process on one device, so test_tensor_parallel.py runs this.
"""

import fcntl
import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["HISPARSE_CONFIGURE_LOGGING"] = "0"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from hisparse_jax import LLM, HiSparseConfig  # noqa: E402
from hisparse_jax.distributed import parallel  # noqa: E402
from hisparse_jax.engine.sampling import SamplingParams  # noqa: E402
from models import data  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.testing import save_random_checkpoint  # noqa: E402

NUM_TOKENS = 16
# Retrieval prompts of ~250 tokens: with the budgets below the device pool holds about
# two at once, so HiSparse offloads decoders and loads their blocks back from the host.
PROMPTS = [list(p.token_ids) for p in data.make_retrieval_prompts(6, 250, seed=3)]
# Device KV GiB at tensor_parallel_size 1: about two prompts' blocks (dense: swap-outs;
# HiSparse, after its key bounds: offloads and host loads).
GQA_SEED = 0
BASE_GIB = dict(default_dense=0.0008, default_hisparse=0.0012, gqa_dense=0.0002,
                gqa_hisparse=0.00027)
HOST_GIB = dict(default_dense=0.004, default_hisparse=0.002, gqa_dense=0.001,
                gqa_hisparse=0.0005)
# Every long decode row sparse, resident or not (resident_sparse_min_tokens=0).
SPARSE = HiSparseConfig(top_k_tokens=32, hot_buffer_tokens=32, sink_tokens=4, local_tokens=8,
                        sparse_threshold_tokens=32, resident_sparse_min_tokens=0)


def gqa_config() -> ModelConfig:
  """A tiny GQA model: 8 query heads over 2 KV heads (groups of 4), so tp 2 splits the KV
  heads and tp 4 repeats each twice; default vocabulary (the retrieval prompts)."""
  return ModelConfig(model_type="llama", vocab_size=len(data.VOCAB), hidden_size=64,
                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                     bos_token_id=data.BOS_ID, eos_token_id=data.EOS_ID,
                     pad_token_id=data.PAD_ID)


def capacity_figures(llm: LLM) -> dict:
  engine = llm.engine
  pools = (engine.device_pool, engine.host_pool)
  live = {kind: parallel.live_bytes(a for p in pools if p.memory_kind == kind
                                    for a in p.arrays())
          for kind in ("device", "pinned_host")}
  reserved = parallel.live_bytes(engine.runner.reserved_arrays())
  report = engine.capacity
  return dict(
      per_device=[dict(kind=t.memory_kind, device=t.device, kv_bytes=t.kv_bytes,
                       reserved_bytes=t.reserved_bytes, num_tokens=t.num_tokens)
                  for t in report.per_device],
      tiers=[dict(kind=t.memory_kind, kv_bytes=t.kv_bytes, reserved_bytes=t.reserved_bytes,
                  num_tokens=t.num_tokens) for t in report.tiers],
      live={kind: {parallel.device_name(d): n for d, n in by.items()}
            for kind, by in live.items()},
      live_reserved={parallel.device_name(d): n for d, n in reserved.items()},
      lines=report.log_lines(256),
      devices=[parallel.device_name(d) for d in engine.device_pool.devices],
      weight_shard_shapes=_shard_shapes(
          engine.runner.params["layers"][0]["self_attn"]["q_proj"]["kernel"][...]))


def _shard_shapes(kernel) -> list[tuple[int, ...]]:
  """The shapes of a weight's shards; one device packs it for the CPU matmul
  (kernels_pallas.packed.PackedWeight, one whole matrix)."""
  if not isinstance(kernel, jax.Array):
    return [tuple(kernel.shape)]
  return sorted({tuple(s.data.shape) for s in kernel.addressable_shards})


def run(case: str, checkpoint: str | None) -> dict:
  out = {}
  for tp in (1, 2, 4):
    # A per-device budget: the same KV blocks at every tensor_parallel_size (the block
    # counts decide preemption and offloading, so the runs schedule alike; HiSparse's
    # tokens depend on it: a swapped-in block's key bounds cover all its slots).
    kv_heads_total = 2 if tp < 4 else 4  # both models: 2 KV heads, repeated at tp 4
    base = BASE_GIB[case]
    host = HOST_GIB[case]
    common = dict(max_model_len=320, max_num_seqs=4, max_num_batched_tokens=128,
                  host_pool_gib=host * kv_heads_total / 2, enable_prefix_caching=False,
                  device_kv_gib=base * kv_heads_total / 2 / tp, tensor_parallel_size=tp)
    if case.endswith("hisparse"):
      common.update(block_size=4, hisparse=SPARSE)
    else:
      common.update(block_size=16)
    llm = LLM(checkpoint, **common)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS,
                                       ignore_eos=True), use_tqdm=False)
    metrics = llm.metrics()
    out[tp] = dict(tokens=[list(o.outputs[0].token_ids) for o in outs],
                   loads=metrics.get("hisparse_hot_buffer_loads_total", 0.0),
                   offloads=metrics.get("hisparse_offloads_total", 0.0),
                   bytes_metrics={k: v for k, v in metrics.items()
                                  if k.startswith("hisparse_kv_capacity_bytes")},
                   d2h_blocks=metrics.get('hisparse_transfer_blocks_total{direction="d2h"}',
                                          0.0),
                   capacity=capacity_figures(llm))
    del llm
  return out


if __name__ == "__main__":
  case, checkpoint = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
  if not case.startswith("gqa"):
    checkpoint = None  # the default model
  else:
    # test_tensor_parallel.py runs two cases at once: one writes the checkpoint.
    with open(os.path.join(checkpoint, ".lock"), "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      if not os.path.isfile(os.path.join(checkpoint, "config.json")):
        save_random_checkpoint(checkpoint, seed=GQA_SEED, config=gqa_config())
  print(json.dumps(run(case, checkpoint)))
