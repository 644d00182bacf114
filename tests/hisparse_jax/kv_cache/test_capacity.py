"""Capacity planning and the capacity log, measured on the allocated pools."""

import collections
import dataclasses
import logging
import re
import types

import jax
import pytest

from hisparse_jax.kv_cache import capacity
from hisparse_jax.kv_cache.capacity import CapacityReport, TierCapacity, plan_capacity
from hisparse_jax.kv_cache.kv_pool import KVCacheSpec
from hisparse_jax.observability.metrics import MetricsRegistry

GIB = 2**30
# 2 layers x K,V x 2 heads x 8 dims x 4 bytes = 256 bytes per token, 4,096 per block.
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=16)

SIZE = r"([\d,]+\.\d\d (?:GiB|MiB))"  # (MiB under 0.01 GiB)
DEVICE_LINE = re.compile(
    r"^KV cache capacity \[memory_kind=device\]: " + SIZE + r" = ([\d,]+) blocks x (\d+) "
    r"tokens = ([\d,]+) tokens(; .*)?$")
HOST_LINE = re.compile(
    r"^KV cache capacity \[memory_kind=pinned_host\]: " + SIZE + r" = ([\d,]+) blocks x "
    r"(\d+) tokens = ([\d,]+) tokens(; .*)?$")
TOTAL_LINE = re.compile(
    r"^KV cache capacity \[total\]: ([\d,]+) tokens; max concurrency for ([\d,]+) tokens "
    r"per request: (\d+\.\d\d)x \(device only: (\d+\.\d\d)x\)$")


def _num(text: str) -> int:
  return int(text.replace(",", ""))


def test_issue_example_lines_exactly():
  report = CapacityReport(tiers=(
      TierCapacity("device", kv_bytes=GIB // 2, num_blocks=2048, block_size=16,
                   num_tokens=32768, num_null_blocks=0, bytes_per_token=16384),
      TierCapacity("pinned_host", kv_bytes=4 * GIB, num_blocks=16384, block_size=16,
                   num_tokens=262144, num_null_blocks=0, bytes_per_token=16384)))
  lines = [line.split("; ")[0] if "[total]" not in line else line
           for line in report.log_lines(32768)]
  assert lines == [
      "KV cache capacity [memory_kind=device]: 0.50 GiB = 2,048 blocks x 16 tokens = "
      "32,768 tokens",
      "KV cache capacity [memory_kind=pinned_host]: 4.00 GiB = 16,384 blocks x 16 tokens = "
      "262,144 tokens",
      "KV cache capacity [total]: 294,912 tokens; max concurrency for 32,768 tokens per "
      "request: 9.00x (device only: 1.00x)",
  ]


def test_report_equals_allocated_arrays_and_logs_three_lines(caplog):
  plan = plan_capacity(SPEC, max_model_len=1024, device_kv_gib=1 / 256, host_pool_gib=1 / 64,
                       device_reserved_bytes=40_960)
  # 4 MiB minus 40,960 reserved bytes = 1,014 blocks of 4,096 bytes; 16 MiB = 4,096 blocks.
  assert (plan.num_device_blocks, plan.num_host_blocks) == (1014, 4096)
  pools = plan.allocate()
  report = CapacityReport.from_pools(pools, plan.device_reserved_bytes)

  allocated = collections.Counter()
  for pool in pools:
    for array in pool.arrays():
      allocated[array.sharding.memory_kind] += array.nbytes
  assert report["device"].kv_bytes == allocated["device"] == 1014 * 4096
  assert report["pinned_host"].kv_bytes == allocated["pinned_host"] == 4096 * 4096
  assert report["device"].num_blocks == 1013  # the null block is never handed out
  assert report["pinned_host"].num_blocks == 4095
  assert [t.memory_kind for t in report] == ["device", "pinned_host"] and len(report) == 2
  for tier in report.tiers:
    assert tier.num_tokens == tier.num_blocks * tier.block_size

  caplog.set_level(logging.INFO, logger="absl")
  report.log(1024)
  lines = [r.getMessage() for r in caplog.records if "KV cache capacity" in r.getMessage()]
  assert len(lines) == 3
  assert all(r.levelno == logging.INFO for r in caplog.records)
  device, host, total = DEVICE_LINE.match(lines[0]), HOST_LINE.match(lines[1]), \
      TOTAL_LINE.match(lines[2])
  assert device and host and total, lines
  assert device.group(1) == f"{1014 * 4096 / 2**20:.2f} MiB"  # (under 0.01 GiB: MiB)
  assert host.group(1) == f"{4096 * 4096 / GIB:.2f} GiB"
  assert (_num(device.group(2)), _num(device.group(3)), _num(device.group(4))) == \
      (1013, 16, 1013 * 16)
  assert (_num(host.group(2)), _num(host.group(4))) == (4095, 4095 * 16)
  assert "256 bytes per token" in device.group(5)
  assert "40,960 bytes reserved for the indexer and hot buffers" in device.group(5)
  assert "null block" in device.group(5)
  assert _num(total.group(1)) == (1013 + 4095) * 16
  # 1,024 tokens are 64 blocks per request.
  assert total.group(3) == f"{(1013 + 4095) / 64:.2f}"
  assert total.group(4) == f"{1013 / 64:.2f}"

  registry = MetricsRegistry()
  report.export(registry)
  assert registry.to_dict() == {
      'hisparse_kv_capacity_tokens{memory_kind="device"}': 1013 * 16,
      'hisparse_kv_capacity_tokens{memory_kind="pinned_host"}': 4095 * 16}


def test_max_concurrency_counts_whole_blocks():
  report = CapacityReport(tiers=(
      TierCapacity("device", kv_bytes=0, num_blocks=100, block_size=16, num_tokens=1600,
                   num_null_blocks=1, bytes_per_token=1),))
  assert report.max_concurrency(160) == 10.0
  assert report.max_concurrency(161) == 100 / 11  # a partial 11th block per request
  with pytest.raises(ValueError, match="tokens_per_request"):
    report.max_concurrency(0)


def test_hisparse_total_line_says_when_no_request_decodes_sparse():
  from hisparse_jax.sparse.config import HiSparseConfig  # noqa: PLC0415

  tiers = tuple(TierCapacity(kind, kv_bytes=0, num_blocks=1000, block_size=16,
                             num_tokens=16_000, num_null_blocks=1, bytes_per_token=1)
                for kind in ("device", "pinned_host"))

  def total_line(hisparse, max_model_len, max_num_seqs=4, max_num_batched_tokens=None):
    detail = capacity.hisparse_capacity(SPEC, hisparse, num_device_blocks=1001,
                                        num_host_blocks=1001, max_num_seqs=max_num_seqs,
                                        max_model_len=max_model_len,
                                        max_num_batched_tokens=max_num_batched_tokens)
    return CapacityReport(tiers=tiers, hisparse=detail).log_lines(max_model_len)[-1]

  # top-k 2,048: the threshold (2 x top-k) is past every request of max_model_len 2,048.
  assert total_line(HiSparseConfig(), 2048).endswith(
      "; HiSparse: requests up to 4,096 tokens decode dense, so none of up to 2,048 decodes "
      "sparse: lower sparse_threshold_tokens (default: 2 x top_k_tokens) below max_model_len")
  # The settings derived from max_model_len decode its longer requests sparse.
  derived = HiSparseConfig.for_max_model_len(2048, 16)
  # As the scheduler admits (test_admission_offload.py): at most max_num_seqs; the host
  # pool's 1,000 blocks hold 7 requests of 128; on the device each running request keeps
  # 64 hot + newest + a spare block, and the last admitted its whole prompt (no
  # streaming: 1 + (1,000 - 128) // 66 = 14) or its first chunk and hot buffer (with
  # chunks of 256 tokens: 1 + (1,000 - 16 - 64) // 66 = 14; of 16: 1 + 935 // 66 = 15).
  assert ("HiSparse runs 4 at once (full KV on pinned_host, hot buffer + newest block on "
          "device; limited by --max_num_seqs)") in total_line(derived, 2048)
  assert "HiSparse runs 7 at once" in total_line(derived, 2048, max_num_seqs=64)
  assert "limited by the pinned_host pool" in total_line(derived, 2048, max_num_seqs=64)
  # A hot buffer of 256 blocks: the device binds. Whole prompts: 1 + (1,000 - 128) // 258
  # = 4; a prompt streams only where its first chunk and hot buffer are less than it.
  big_hot = dataclasses.replace(derived, hot_buffer_tokens=4096, sparse_threshold_tokens=1024)
  assert ("HiSparse runs 4 at once (full KV on pinned_host, hot buffer + newest block on "
          "device; limited by device: each also keeps a spare block, and the last admitted "
          "needs its whole prompt)") in total_line(big_hot, 2048, max_num_seqs=64,
                                                   max_num_batched_tokens=256)
  # A hot buffer of 16 blocks and chunks of 256 tokens: 1 + (1,000 - 32) // 18 = 54.
  small_hot = HiSparseConfig(top_k_tokens=128, hot_buffer_tokens=256)
  big_host = tuple(dataclasses.replace(t, num_blocks=10_000) if t.memory_kind == "pinned_host"
                   else t for t in tiers)
  detail = capacity.hisparse_capacity(SPEC, small_hot, num_device_blocks=1001,
                                      num_host_blocks=10_001, max_num_seqs=64,
                                      max_model_len=2048, max_num_batched_tokens=256)
  line = CapacityReport(tiers=big_host, hisparse=detail).log_lines(2048)[-1]
  assert ("HiSparse runs 54 at once (full KV on pinned_host, hot buffer + newest block on "
          "device; limited by device: each also keeps a spare block, and the last admitted "
          "needs its first prefill chunk and hot buffer)") in line
  wait = dataclasses.replace(derived, admission="wait")
  assert "HiSparse admission 'wait': a waiting request waits" in total_line(wait, 2048)


def test_cpu_default_device_budget():
  assert jax.devices()[0].memory_stats() is None
  plan = plan_capacity(SPEC, max_model_len=1024, host_pool_gib=1 / 64)
  assert plan.device_budget_source == "default"
  assert plan.device_budget_bytes == int(capacity.DEFAULT_DEVICE_KV_GIB * GIB)
  assert plan.num_device_blocks == plan.device_budget_bytes // SPEC.bytes_per_block
  # Reserved bytes (HiSparse's key bounds, hot-buffer state) come on top of the default:
  # the same blocks, a larger budget. A budget the user gives pays for them (above).
  reserving = plan_capacity(SPEC, max_model_len=1024, host_pool_gib=1 / 64,
                            device_reserved_bytes=40_960)
  assert reserving.num_device_blocks == plan.num_device_blocks
  assert reserving.device_budget_bytes == plan.device_budget_bytes + 40_960
  big = capacity.plan_capacity_reserving(SPEC, lambda d, h: 2 * plan.device_budget_bytes,
                                         max_model_len=1024, host_pool_gib=1 / 64)
  assert big.num_device_blocks == plan.num_device_blocks
  assert big.device_reserved_bytes == 2 * plan.device_budget_bytes


def _fake_device(bytes_limit, bytes_in_use):
  stats = {"bytes_limit": bytes_limit, "bytes_in_use": bytes_in_use}
  return types.SimpleNamespace(memory_stats=lambda: stats)


def test_budget_from_memory_stats_after_the_weights():
  device = _fake_device(bytes_limit=100 * 2**20, bytes_in_use=20 * 2**20)
  plan = plan_capacity(SPEC, max_model_len=1024, host_pool_gib=1 / 64, device=device,
                       device_memory_fraction=0.5)
  assert plan.device_budget_source == "memory_stats"
  assert plan.device_budget_bytes == 40 * 2**20
  assert plan.num_device_blocks == 40 * 2**20 // 4096
  with pytest.raises(ValueError, match=r"--device_kv_gib=1 asks for 1\.00 GiB but only "
                                       r"0\.08 GiB of device memory is free"):
    plan_capacity(SPEC, max_model_len=1024, host_pool_gib=1 / 64, device=device,
                  device_kv_gib=1)


def test_host_pool_above_95_percent_of_available_ram_is_refused(monkeypatch):
  ram = types.SimpleNamespace(available=2 * GIB, total=4 * GIB)
  monkeypatch.setattr(capacity.psutil, "virtual_memory", lambda: ram)
  with pytest.raises(ValueError) as e:
    plan_capacity(SPEC, max_model_len=1024, device_kv_gib=0.01, host_pool_gib=1.92)
  message = str(e.value)
  assert "--host_pool_gib=1.92" in message
  assert "1.92 GiB" in message and "2.00 GiB available" in message
  assert "at most 1.90 GiB" in message
  # On CPU the device pool is host RAM too: both pools together must fit the 95%.
  with pytest.raises(ValueError, match=r"--device_kv_gib=0.01 and --host_pool_gib=1.9 ask "
                     r"for 1.91 GiB in all; on CPU both pools are host RAM"):
    plan_capacity(SPEC, max_model_len=1024, device_kv_gib=0.01, host_pool_gib=1.9)
  plan = plan_capacity(SPEC, max_model_len=1024, device_kv_gib=0.01, host_pool_gib=1.89)
  assert plan.num_host_blocks == int(1.89 * GIB) // 4096


@pytest.mark.parametrize("kwargs, match", [
    # 64 blocks of 4,096 bytes + the null block do not fit in 64 blocks' worth of bytes.
    (dict(device_kv_gib=64 * 4096 / GIB, host_pool_gib=1 / 64),
     r"--device_kv_gib: .* holds 63 usable blocks .* needs 64 blocks of 16 tokens"),
    (dict(device_kv_gib=1 / 64, host_pool_gib=1 / 64, device_reserved_bytes=(1 / 64) * GIB),
     r"--device_kv_gib: .* holds 0 usable blocks"),
    (dict(device_kv_gib=1 / 64, host_pool_gib=64 * 4096 / GIB),
     r"--host_pool_gib=.* holds 63 usable blocks .* one request of --max_model_len=1,024"),
    (dict(device_kv_gib=1 / 64, host_pool_gib=0), r"--host_pool_gib=0 .* holds 0 usable"),
    (dict(device_kv_gib=-1, host_pool_gib=1), r"--device_kv_gib must be positive"),
])
def test_too_small_tiers_are_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    plan_capacity(SPEC, max_model_len=1024, **kwargs)


def test_one_request_that_just_fits():
  plan = plan_capacity(SPEC, max_model_len=1024, device_kv_gib=65 * 4096 / GIB,
                       host_pool_gib=65 * 4096 / GIB)
  report = CapacityReport.from_pools(plan.allocate())
  assert report.max_concurrency(1024, ("device",)) == 1.0
  assert report.max_concurrency(1024) == 2.0


def test_plan_capacity_reserving_takes_the_most_blocks_whose_reservation_fits():
  # 4,096-byte blocks; the reservation grows by 512 bytes per device block and 256 per
  # host block, plus 1,000 bytes: like HiSparse's key bounds and hot-buffer state.
  def reserved(num_device_blocks, num_host_blocks):
    return 512 * num_device_blocks + 256 * num_host_blocks + 1000

  args = dict(max_model_len=64, host_pool_gib=40 * 4096 / GIB, device_kv_gib=100 * 4096 / GIB)
  plan = capacity.plan_capacity_reserving(SPEC, reserved, **args)
  budget = 100 * 4096
  n, h = plan.num_device_blocks, plan.num_host_blocks
  assert h == 40 and plan.device_reserved_bytes == reserved(n, h)
  assert n * 4096 + reserved(n, h) <= budget  # fits
  assert (n + 1) * 4096 + reserved(n + 1, h) > budget  # one more block would not
  assert n == (budget - 256 * 40 - 1000) // (4096 + 512) == 86
  with pytest.raises(ValueError, match="--device_kv_gib"):  # too little for one request
    capacity.plan_capacity_reserving(SPEC, lambda d, h: 97 * 4096, **args)


def _hisparse_device_tokens(bounds_dtype: str, host_over_device: float) -> int | None:
  """Device tokens of a block-size-4 HiSparse plan for the default model's cache shape
  (2 layers, 2 KV heads of 32, float32: 1 KiB a token) at a 0.01 GiB device budget and a
  host pool `host_over_device` times that; None when the plan is refused."""
  from hisparse_jax.sparse.config import HiSparseConfig  # noqa: PLC0415

  spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32",
                     block_size=4)
  hisparse = HiSparseConfig.for_max_model_len(2048, 4, bounds_dtype=bounds_dtype)
  sizes = dict(max_num_seqs=256, max_model_len=2048)
  try:
    plan = capacity.plan_capacity_reserving(
        spec, lambda d, h: capacity.hisparse_capacity(
            spec, hisparse, num_device_blocks=d, num_host_blocks=h, **sizes).reserved_bytes,
        max_model_len=2048, device_kv_gib=0.01, host_pool_gib=0.01 * host_over_device)
  except ValueError:
    return None
  # The plan fits: blocks + the bounds of every block + hot-buffer state <= the budget.
  detail = capacity.hisparse_capacity(spec, hisparse, num_device_blocks=plan.num_device_blocks,
                                      num_host_blocks=plan.num_host_blocks, **sizes)
  assert detail.reserved_bytes == plan.device_reserved_bytes
  assert (plan.num_device_blocks * spec.bytes_per_block + detail.reserved_bytes
          <= plan.device_budget_bytes)
  return (plan.num_device_blocks - 1) * spec.block_size


def test_bfloat16_bounds_hold_more_device_tokens_beside_a_larger_host_pool():
  # Float32 bounds of a 4-token float32 block are a quarter of its bytes: a host pool 4x
  # the device budget needs the whole budget for its bounds (refused), and at 2x they
  # take half of it. bfloat16 bounds take half as much. (The hot-buffer state: a row per
  # request the device can hold offloaded, num_hot_rows: 6 or fewer here, not 256.)
  assert _hisparse_device_tokens("float32", 4) is None
  assert _hisparse_device_tokens("bfloat16", 4) == 4628
  f32, bf16 = _hisparse_device_tokens("float32", 2), _hisparse_device_tokens("bfloat16", 2)
  assert (f32, bf16) == (4164, 6944) and bf16 >= 1.6 * f32


def test_int8_bounds_hold_more_device_tokens_than_bfloat16_ones():
  # int8 bounds of head_dim 32: 32 values + a float32 scale per side and KV head, 36 bytes
  # against bfloat16's 64: an 8x host pool still fits a 0.01 GiB device budget.
  assert _hisparse_device_tokens("bfloat16", 8) is None
  int8 = {r: _hisparse_device_tokens("int8", r) for r in (2, 4, 8)}
  assert int8 == {2: 8352, 4: 6992, 8: 4252}
  assert int8[2] > 1.2 * 6944 and int8[4] > 1.5 * 4628  # bfloat16's, above
