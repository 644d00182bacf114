"""The engine's programs compiled for an NVIDIA H200 by XLA's GPU compiler, without a GPU.

Each case builds the engine of a config for the h200 target (hisparse_jax/engine/aot.py:
the capacity plan the H200's memory gives, abstract pools and model) and compiles its
largest programs of a kind through the target topology's compile-only client: Triton and
Mosaic GPU kernels, XLA's host offloader (the stage that rejected every HiSparse step on
the real H200 in session 24), PTX. The toy model's shapes keep each compile to seconds.
Tensor parallelism over a 1x2 topology needs two CPU devices to lower from: it runs
through the CLI (tests/hisparse_jax/entrypoints/test_compile_cli.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re

import jax
import jax.numpy as jnp
import pytest

from hisparse_jax import HiSparseConfig
from hisparse_jax.engine import aot, aot_compile
from hisparse_jax.engine.config import EngineConfig
from hisparse_jax.engine.gpu_target import TargetError, load_target, parse_target
from hisparse_jax.kv_cache import transfer
from hisparse_jax.sparse import resolver

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
    reason="XLA's GPU compiler is not installed (jax[cuda13]; make setup installs it)")

SMALL = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128)
HISPARSE = HiSparseConfig(top_k_tokens=64, hot_buffer_tokens=128, sink_tokens=16,
                          local_tokens=16, sparse_threshold_tokens=64)


@pytest.fixture(scope="module")
def h200():
  return load_target("h200")


def _compile(config: EngineConfig, names: set[str], target="h200"):
  build = aot.AotBuild(config, load_target(target))
  report = aot_compile.compile_programs(build, names)
  assert {p.name for p in report.programs} == names
  for p in report.programs:
    assert p.error is None, (p.name, p.error)
  return build, {p.name: p for p in report.programs}


def test_the_dense_bfloat16_engine_compiles_with_its_swap_programs(h200):
  build, progs = _compile(EngineConfig(dtype="bfloat16", **SMALL),
                          {"prefill", "decode", "swap_out", "swap_in"})
  # The plan is the H200's: 0.9 of (0.75 x 140.4 GiB - the weights) in KV blocks.
  assert build.plan.device_budget_source == "memory_stats"
  assert build.kv_bytes == int(0.9 * (h200.bytes_limit() - build.weight_bytes))
  pool_bytes = build.plan.num_device_blocks * build.spec.bytes_per_block
  for name in ("prefill", "decode"):
    p = progs[name]
    assert p.kernels == ("ragged_paged_attention", "write_kv")
    assert p.argument_bytes >= pool_bytes  # the whole device pool is an argument ...
    assert p.alias_bytes >= pool_bytes  # ... updated in place (donated)
    assert 0 < p.temp_bytes < build.reserve_bytes
    assert p.host_copies == 0  # a dense step never touches pinned_host
  # The swaps cross between HBM and pinned host memory: copies in the compiled program,
  # the host pool counted as host (not device) argument bytes.
  for name in ("swap_out", "swap_in"):
    assert progs[name].host_copies > 0
    assert progs[name].host_bytes == build.plan.num_host_blocks * build.spec.bytes_per_block


def test_hisparse_with_int8_kv_compiles_its_in_step_host_loads():
  config = EngineConfig(hisparse=HISPARSE, kv_cache_dtype="int8", host_pool_gib=0.5, **SMALL)
  build, progs = _compile(config, {"tiered_decode", "refresh_bounds", "bounds_to_host_index"})
  p = progs["tiered_decode"]
  # (block_scores: the select scores the key bounds where they lie, no gathered copy)
  assert set(p.kernels) == {"block_key_bounds", "block_scores", "paged_attention",
                            "ragged_paged_attention", "write_kv"}
  assert p.host_copies > 0  # the misses cross from pinned_host inside the step
  assert p.host_bytes > 0  # the host pool (int8 values + float32 scales) is an argument
  assert progs["refresh_bounds"].kernels == ("block_key_bounds",)


def test_hisparse_with_int8_key_bounds_compiles_its_kernels_over_them():
  # --bounds_dtype=int8: QuantizedBounds (int8 values, a float32 scale per block, side and
  # KV head) written by block_key_bounds and scored in place by block_scores.
  hisparse = dataclasses.replace(HISPARSE, bounds_dtype="int8")
  config = EngineConfig(hisparse=hisparse, dtype="bfloat16", host_pool_gib=0.5, **SMALL)
  build, progs = _compile(config, {"tiered_decode", "refresh_bounds", "bounds_to_host_index"})
  assert {"block_key_bounds", "block_scores"} <= set(progs["tiered_decode"].kernels)
  assert progs["refresh_bounds"].kernels == ("block_key_bounds",)
  spec, plan = build.spec, build.plan
  rows = plan.num_device_blocks + plan.num_host_blocks
  # The bounds are the copy program's whole argument: rows x layers x 2 sides x KV heads
  # x (head_dim int8 values + a float32 scale), donated.
  int8_bytes = rows * spec.num_layers * 2 * spec.num_kv_heads * (spec.head_dim + 4)
  assert progs["bounds_to_host_index"].argument_bytes - 2 * 4 * aot.ID_BUCKET == int8_bytes
  assert progs["bounds_to_host_index"].alias_bytes == int8_bytes


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_zero_copy_kernel_moves_blocks_with_no_copy_and_no_host_computation(
    kv_cache_dtype, monkeypatch):
  # HISPARSE_JAX_HOST_COPY=kernel: the in-step loads and the swaps are kernels reading /
  # writing the pinned pool in place (kernels_pallas.block_copy), no XLA host offloading.
  monkeypatch.setenv(transfer.HOST_COPY_ENV, "kernel")
  config = EngineConfig(hisparse=HISPARSE, kv_cache_dtype=kv_cache_dtype, host_pool_gib=0.5,
                        **SMALL)
  build, progs = _compile(config, {"tiered_decode", "swap_out", "swap_in"})
  host_pool = build.plan.num_host_blocks * build.spec.bytes_per_block
  for name, p in progs.items():
    assert "block_copy" in p.kernels, name
    assert p.host_copies == 0, name  # nothing crosses through XLA's copies ...
    assert p.host_bytes >= host_pool, name  # ... the kernels take the host pool itself
  # No device copy of the host pool either: the step's temporaries fit the reserve.
  assert 0 < progs["tiered_decode"].temp_bytes < build.reserve_bytes


def test_a_prompt_longer_than_the_device_pool_compiles_its_streamed_chunks():
  for mode in ("exact", "sparse"):
    hisparse = HiSparseConfig(top_k_tokens=64, hot_buffer_tokens=128, sink_tokens=16,
                              local_tokens=16, sparse_threshold_tokens=64,
                              streamed_prefill=mode)
    _, progs = _compile(EngineConfig(hisparse=hisparse, host_pool_gib=0.5, **SMALL),
                        {"streamed_prefill"})
    p = progs["streamed_prefill"]
    assert p.host_copies > 0, mode
    assert "ragged_paged_attention" in p.kernels


# (8-bit KV overlaps its values' copies the same way: checked when written, left out of the
# suite for its ~30 s compile.)
@pytest.mark.parametrize(("kv_cache_dtype", "backend"),
                         [("auto", "auto"), ("auto", "pallas_mgpu")])
def test_overlapped_loads_cross_while_the_on_device_blocks_are_attended(
    kv_cache_dtype, backend, monkeypatch):
  # HISPARSE_JAX_OVERLAP_LOADS=1: each layer's first staged loads (resolver.staged_gather:
  # a host-side gather into a pinned staging buffer, then one host -> device copy per
  # pool array) compile to copy-start / copy-done pairs with the attention over the blocks
  # already on the device scheduled between them (XLA's latency-hiding scheduler, which the
  # step's compiler options turn on); the loaded misses' attention comes after.
  monkeypatch.setenv(resolver.OVERLAP_LOADS_ENV, "1")
  dtype = "bfloat16" if backend == "pallas_mgpu" else "auto"
  config = EngineConfig(hisparse=HISPARSE, kv_cache_dtype=kv_cache_dtype, dtype=dtype,
                        kernel_backend=backend, host_pool_gib=0.5, **SMALL)
  build, progs = _compile(config, {"tiered_decode"})
  p = progs["tiered_decode"]
  attention = "paged_attention_mgpu" if backend == "pallas_mgpu" else "paged_attention"
  # Two copies a layer, K's and V's blocks. (8-bit KV: the values'; the scales' copies,
  # 4 bytes a token and head beside the values' head_dim, come earlier, each start right
  # before its done: XLA limits the copies in flight.)
  assert len(p.overlapped) == 2 * build.spec.num_layers, p.overlapped
  assert {kernels for _, kernels in p.overlapped} == {(attention,)}, p.overlapped
  # (The option off, no copy has a kernel beside it: the default model's tiered_decode in
  # tests/hisparse_jax/entrypoints/test_compile_cli.py.)


def test_the_mosaic_gpu_decode_kernel_compiles_for_sm90a():
  config = EngineConfig(hisparse=HISPARSE, dtype="bfloat16", kernel_backend="pallas_mgpu",
                        host_pool_gib=0.5, **SMALL)
  _, progs = _compile(config, {"tiered_decode"})
  kernels = progs["tiered_decode"].kernels
  assert "paged_attention_mgpu (mosaic_gpu)" in kernels
  # The dense rows (bfloat16 KV, blocks of 8) take the Mosaic GPU ragged kernel too.
  assert "ragged_paged_attention_mgpu (mosaic_gpu)" in kernels
  assert "ragged_paged_attention" not in kernels


def test_the_mosaic_gpu_backend_decodes_head_dim_80_on_triton(tmp_path):
  # head_dim 80 (Phi-2's) is not a multiple of the 32 the WGMMA tiles need: the
  # pallas_mgpu backend's decode falls back to the Triton kernel for that shape (session
  # 38's compile sweep: it failed to compile before), the dense rows likewise.
  from models import data, testing  # noqa: PLC0415
  from models.config import ModelConfig  # noqa: PLC0415

  config = ModelConfig(model_type="llama", vocab_size=len(data.VOCAB), hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=80, max_position_embeddings=4096,
                       bos_token_id=data.BOS_ID, eos_token_id=data.EOS_ID)
  path = testing.save_random_checkpoint(tmp_path / "hd80", config=config)
  engine = EngineConfig(model=path, hisparse=HISPARSE, dtype="bfloat16",
                        kernel_backend="pallas_mgpu", host_pool_gib=0.5, **SMALL)
  _, progs = _compile(engine, {"tiered_decode"})
  kernels = progs["tiered_decode"].kernels
  assert "paged_attention" in kernels and "ragged_paged_attention" in kernels
  assert not any("mosaic_gpu" in k for k in kernels), kernels


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_the_mosaic_gpu_decode_kernel_over_8bit_kv_compiles_for_sm90a(kv_cache_dtype):
  config = EngineConfig(hisparse=HISPARSE, dtype="bfloat16", kernel_backend="pallas_mgpu",
                        kv_cache_dtype=kv_cache_dtype, host_pool_gib=0.5, **SMALL)
  _, progs = _compile(config, {"tiered_decode"})
  kernels = progs["tiered_decode"].kernels
  assert "paged_attention_mgpu (mosaic_gpu)" in kernels
  assert "paged_attention" not in kernels  # no Triton decode beside it
  assert "ragged_paged_attention" in kernels  # 8-bit KV: the dense rows stay on Triton


@pytest.mark.parametrize("host_copy", ["xla", "kernel"])
def test_a_dsa_model_with_offload_compiles_its_token_loads(host_copy, tmp_path, monkeypatch):
  monkeypatch.setenv(transfer.HOST_COPY_ENV, host_copy)
  transformers = pytest.importorskip("transformers")
  from models.testing import DSA_TINY_HF_CONFIG  # noqa: PLC0415

  transformers.DeepseekV32Config(**DSA_TINY_HF_CONFIG).save_pretrained(tmp_path)
  lightning = HiSparseConfig(indexer="lightning", hot_buffer_tokens=16)
  config = EngineConfig(model=str(tmp_path), hisparse=lightning,
                        max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                        host_pool_gib=0.1)
  # (The resident decode has no host path, whatever the host copy: compiled once, with xla.)
  names = {"tiered_decode", "index_keys_to_host"} | ({"decode"} if host_copy == "xla" else set())
  build, progs = _compile(config, names)
  assert build.is_dsa and build.config.hisparse.indexer == "lightning"
  tiered = progs["tiered_decode"]
  # (index_scores: the lightning indexer scores the paged keys where they lie)
  if host_copy == "xla":
    assert tiered.kernels == ("index_scores", "sparse_mla_decode")
    assert tiered.host_copies > 0  # the missed tokens cross from the host
    assert progs["decode"].host_copies == 0  # resident rows attend their top-k in place
  else:  # the zero-copy kernel reads the missed tokens' rows from the pinned pool
    assert set(tiered.kernels) == {"block_copy", "index_scores", "sparse_mla_decode"}
    assert tiered.host_copies == 0 and tiered.host_bytes > 0


@pytest.mark.parametrize("index_cache_dtype", ["int8", "fp8_e4m3"])
def test_a_dsa_model_with_8bit_indexer_keys_compiles_its_steps_and_key_copies(
    index_cache_dtype, tmp_path):
  # The indexer reads 8-bit keys and their scales in place (device pool and the device
  # copy of the host blocks' keys); the keys' copy to the host index moves both arrays.
  transformers = pytest.importorskip("transformers")
  from models.testing import DSA_TINY_HF_CONFIG  # noqa: PLC0415

  transformers.DeepseekV32Config(**DSA_TINY_HF_CONFIG).save_pretrained(tmp_path)
  lightning = HiSparseConfig(indexer="lightning", hot_buffer_tokens=16)
  config = EngineConfig(model=str(tmp_path), hisparse=lightning, dtype="bfloat16",
                        index_cache_dtype=index_cache_dtype, max_model_len=256,
                        max_num_seqs=4, max_num_batched_tokens=64, host_pool_gib=0.1)
  build, progs = _compile(config, {"decode", "tiered_decode", "index_keys_to_host"})
  spec = build.spec
  assert spec.index_quantized and spec.index_bytes_per_token == len(spec.index_layers) * (
      DSA_TINY_HF_CONFIG["index_head_dim"] + 4)
  for name in ("decode", "tiered_decode"):
    assert progs[name].kernels == ("index_scores", "sparse_mla_decode"), progs[name]
  assert progs["tiered_decode"].host_copies > 0
  assert progs["index_keys_to_host"].host_copies == 0  # (device -> its device copy)


def test_a_dsa_model_on_pallas_mgpu_compiles_the_mosaic_gpu_sparse_mla_decode(tmp_path):
  # The Mosaic GPU sparse MLA decode takes kv_lora_rank a multiple of 64 and rope 64
  # (DeepSeek's 512 + 64): the tiny DSA model at 64 + 64, bfloat16.
  transformers = pytest.importorskip("transformers")
  from models.testing import DSA_TINY_HF_CONFIG  # noqa: PLC0415

  hf = dict(DSA_TINY_HF_CONFIG, kv_lora_rank=64, qk_rope_head_dim=64, index_head_dim=64)
  transformers.DeepseekV32Config(**hf).save_pretrained(tmp_path)
  lightning = HiSparseConfig(indexer="lightning", hot_buffer_tokens=16)
  config = EngineConfig(model=str(tmp_path), hisparse=lightning, dtype="bfloat16",
                        kernel_backend="pallas_mgpu", max_model_len=256, max_num_seqs=4,
                        max_num_batched_tokens=64, host_pool_gib=0.1)
  _, progs = _compile(config, {"decode", "tiered_decode"})
  for name in ("decode", "tiered_decode"):
    assert progs[name].kernels == ("index_scores", "sparse_mla_decode_mgpu (mosaic_gpu)"), (
        progs[name])
  # The tiny model's own 32 + 16 is refused by name at planning, not deep in a trace.
  transformers.DeepseekV32Config(**DSA_TINY_HF_CONFIG).save_pretrained(tmp_path)
  with pytest.raises(ValueError, match="kv_lora_rank 32, qk_rope_head_dim 16"):
    aot.AotBuild(config, load_target("h200"))


def test_fp8_kv_is_refused_on_an_a100_and_compiles_on_an_h100():
  with pytest.raises(ValueError, match=r"kv_cache_dtype=fp8_e4m3 needs a GPU of compute "
                                       r"capability 8\.9.*A100.* has 8\.0"):
    aot.AotBuild(EngineConfig(kv_cache_dtype="fp8_e4m3", **SMALL), load_target("a100"))
  _compile(EngineConfig(kv_cache_dtype="fp8_e4m3", **SMALL), {"decode"}, target="h100")


def test_temporaries_beyond_the_budgets_reserve_are_refused(h200):
  # --device_kv_gib leaving ~8 MiB beside the weights; a 2,048-token prefill needs more.
  build = aot.AotBuild(EngineConfig(device_kv_gib=105.29), h200)
  report = aot_compile.compile_programs(build, {"prefill"})
  assert report.programs[0].temp_bytes > build.reserve_bytes > 0
  with pytest.raises(ValueError, match=r"the compiled program 'prefill' needs .* of device "
                                       r"temporaries, but --device_kv_gib leaves"):
    report.check_footprint()
  # The default budget (0.9 of what the weights leave) has room.
  report = aot_compile.compile_programs(aot.AotBuild(EngineConfig(), h200), {"prefill"})
  report.check_footprint()
  json.dumps(report.to_json(), default=str)


def test_the_compiler_rejects_host_loads_inside_a_conditional(h200):
  """What the check is for: the host offloader's verdict, reached without a GPU. The
  in-step load as it was before session 24 (a lax.switch over load sizes, each branch a
  host gather) failed on the real H200 with exactly this error; the while loop of fixed
  trips that replaced it compiles (test_hisparse_with_int8_kv_...)."""
  build = aot.AotBuild(EngineConfig(**SMALL), h200)
  device, host = build.device_pool, build.host_pool
  total, sizes = 32, (0, 8, 16, 32)
  gather = transfer.gather_program(2, device.sharding, host.sharding)

  def load(host_arrays, device_arrays, ids, which):
    def fetch(size):
      def branch(host_arrays, ids):
        if size == 0:
          return tuple(jnp.zeros((total, *a.shape[1:]), a.dtype) for a in device_arrays)
        pad = ((0, total - size),) + ((0, 0),) * 3
        return tuple(jnp.pad(b, pad) for b in gather(host_arrays, ids[:size]))
      return branch
    blocks = jax.lax.switch(which, [fetch(n) for n in sizes], host_arrays, ids)
    return tuple(d.at[ids].set(b, mode="drop") for d, b in zip(device_arrays, blocks))

  ids = jax.ShapeDtypeStruct((total,), jnp.int32, sharding=device.sharding)
  which = jax.ShapeDtypeStruct((), jnp.int32, sharding=device.sharding)
  program = aot.Program("switch_load", "step", jax.jit(load, donate_argnums=(1,)),
                        (host.arrays()[:2], device.arrays()[:2], ids, which))
  result = aot_compile.compile_program(build, program)
  assert result.error is not None, "host loads inside a conditional compiled"
  assert re.search(r"Expected computation \S+ to be called only by one caller and that "
                   r"caller to be a While", result.error), result.error


def test_targets_parse_and_refuse_bad_files(tmp_path):
  h100 = load_target("h100")
  assert (h100.device_kind, h100.sm, h100.core_count) == ("NVIDIA H100 80GB HBM3", "sm_90",
                                                           132)
  assert load_target("a100").compute_capability == (8, 0)
  path = tmp_path / "mine.textproto"
  path.write_text(load_target("h200").config_text)
  assert load_target(str(path)).device_kind == "NVIDIA H200"
  with pytest.raises(TargetError, match="--target='b200': not one of h200, h100, a100"):
    load_target("b200")
  with pytest.raises(TargetError, match="no cuda_compute_capability"):
    parse_target('device_description_str: "x"', "bad")
