"""`hisparse-jax compile --target=...`: the whole CLI, as a user runs it (subprocesses).

The default model's every program and the --hisparse ones compile for the H200 (exit 0,
the table, the JSON); tensor parallelism over a 1x2 H200 topology; a checkpoint of the
8B head geometry with 8-bit HiSparse for the H100; configs that cannot run there exit 2
with one line naming the cause.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
    reason="XLA's GPU compiler is not installed (jax[cuda13]; make setup installs it)")

DENSE = {"prefill", "decode", "mixed", "swap_out", "swap_in", "copy_on_write"}
HISPARSE = DENSE | {"tiered_decode", "bounds_to_host_index", "refresh_bounds"}


def _compile(tmp_path, *args, env=None):
  out = tmp_path / "report.json"
  r = subprocess.run([sys.executable, "-m", "hisparse_jax", "compile", f"--out={out}", *args],
                     capture_output=True, text=True, timeout=600,
                     env={**os.environ, **(env or {})})
  report = json.loads(out.read_text()) if out.exists() else None
  return r, report


def _table_rows(stdout: str) -> dict[str, list[str]]:
  lines = stdout.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("program "))
  rows = {}
  for line in lines[start + 1:]:
    if line.startswith("wrote "):
      break
    cells = line.split()
    rows[cells[0]] = cells
  return rows


# (The dense config's programs, DENSE, ~30 s: the same command without --hisparse, left out
# of the suite for its time; its prefill, decode and swaps compile in test_aot_h200.py and
# its decode through README's `compile` line in tests/test_readme_commands.py.)
def test_every_program_of_the_default_model_compiles_for_the_h200(tmp_path):
  # (XLA's GPU autotuner off, as conftest.py sets it for the suite; README's two `compile`
  # lines run with it on, as a user runs them: tests/test_readme_commands.py.)
  programs = HISPARSE
  r, report = _compile(tmp_path, "--target=h200", "--hisparse")
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.startswith("compiling for NVIDIA H200 (sm_90, h200): hisparse-tiny")
  rows = _table_rows(r.stdout)
  assert set(rows) == programs
  assert "FAILED" not in r.stdout
  assert {p["name"] for p in report["programs"]} == programs
  assert all(p["error"] is None for p in report["programs"])
  assert report["target"]["device_kind"] == "NVIDIA H200"
  memory = report["memory_per_device"]
  assert memory["reserve"] > max(p["temp_bytes"] for p in report["programs"]) > 0
  # The in-step host loads are in the compiled decode.
  tiered = next(p for p in report["programs"] if p["name"] == "tiered_decode")
  assert tiered["host_copies"] > 0 and "paged_attention" in tiered["kernels"]
  # Overlapped loads are opt-in (HISPARSE_JAX_OVERLAP_LOADS): off, no load crosses beside an
  # attention kernel (on: test_aot_h200.py's test_overlapped_loads_...).
  assert tiered["overlapped"] == []


def test_tensor_parallel_over_two_h200s(tmp_path):
  # (the suite's processes have one CPU device; the command makes the two it lowers from)
  r, report = _compile(tmp_path, "--target=h200", "--tensor_parallel_size=2",
                       "--max_model_len=512", "--max_num_seqs=8",
                       "--max_num_batched_tokens=128", "--programs=decode,swap_in",
                       env={"XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
  assert r.returncode == 0, r.stderr[-2000:]
  assert "tensor parallel 2" in r.stdout.splitlines()[0]
  assert {p["name"] for p in report["programs"]} == {"decode", "swap_in"}
  assert all(p["error"] is None for p in report["programs"])


@pytest.mark.parametrize("args,line", [
    (["--target=a100", "--kv_cache_dtype=fp8_e4m3"],
     r"hisparse-jax compile: error: kv_cache_dtype=fp8_e4m3 needs a GPU of compute capability "
     r"8\.9 or newer"),
    (["--target=h200", "--device_kv_gib=105.29", "--programs=prefill"],
     r"hisparse-jax compile: error: the compiled program 'prefill' needs [\d.]+ MiB of device "
     r"temporaries, but --device_kv_gib leaves [\d.]+ MiB beside the weights"),
    (["--target=b200"], r"hisparse-jax compile: error: --target='b200': not one of h200, "
                        r"h100, a100"),
    (["--target=h200", "--programs=nope"], r"hisparse-jax compile: error: --programs: nope is "
                                           r"not a program of this config"),
], ids=["fp8-on-a100", "temporaries-over-budget", "unknown-target", "unknown-program"])
def test_a_config_that_cannot_run_exits_2_with_one_line(tmp_path, args, line):
  r, _ = _compile(tmp_path, *args)
  assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
  errors = [ln for ln in r.stderr.splitlines() if ln.startswith("hisparse-jax compile:")]
  assert len(errors) == 1 and re.match(line, errors[0]), r.stderr[-2000:]


def test_a_checkpoint_of_the_8b_head_geometry_compiles_hisparse_int8_for_the_h100(tmp_path):
  """The toy model's heads are 8 wide; a checkpoint directory with Llama-3.1-8B's head
  geometry (GQA 4:1, head_dim 128; 2 small layers) compiles its 8-bit HiSparse decode
  programs for sm_90 through the CLI, as a user's own checkpoint would."""
  from models import data, testing  # noqa: PLC0415
  from models.config import ModelConfig  # noqa: PLC0415

  config = ModelConfig(model_type="llama", vocab_size=len(data.VOCAB), hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=128, max_position_embeddings=4096,
                       bos_token_id=data.BOS_ID, eos_token_id=data.EOS_ID,
                       pad_token_id=data.PAD_ID)
  ckpt = testing.save_random_checkpoint(tmp_path / "ckpt", config=config)
  r, report = _compile(tmp_path, "--target=h100", f"--model={ckpt}", "--dtype=bfloat16",
                       "--hisparse", "--kv_cache_dtype=int8", "--max_model_len=1024",
                       "--device_kv_gib=0.05", "--host_pool_gib=0.1",
                       "--programs=decode,tiered_decode")
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.startswith("compiling for NVIDIA H100")
  assert {p["name"] for p in report["programs"]} == {"decode", "tiered_decode"}
  assert all(p["error"] is None for p in report["programs"])
  tiered = next(p for p in report["programs"] if p["name"] == "tiered_decode")
  assert tiered["host_copies"] > 0 and "paged_attention" in tiered["kernels"]


def test_fp8_indexer_keys_of_a_dsa_model_exit_2_on_the_a100_and_compile_for_the_h200(
    tmp_path):
  # The indexer kernel converts fp8 keys with sm_89 instructions: the A100 is refused
  # before anything compiles, naming the flag; the H200 compiles the DSA steps.
  transformers = pytest.importorskip("transformers")
  from models.testing import DSA_TINY_HF_CONFIG  # noqa: PLC0415

  model = tmp_path / "dsa"
  transformers.DeepseekV32Config(**DSA_TINY_HF_CONFIG).save_pretrained(model)
  args = (f"--model={model}", "--index_cache_dtype=fp8_e4m3", "--dtype=bfloat16",
          "--max_model_len=256", "--max_num_seqs=4", "--hisparse", "--hot_buffer_tokens=16",
          "--host_pool_gib=0.1")
  r, _ = _compile(tmp_path, "--target=a100", *args)
  assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
  errors = [ln for ln in r.stderr.splitlines() if ln.startswith("hisparse-jax compile:")]
  assert errors == ["hisparse-jax compile: error: index_cache_dtype=fp8_e4m3 needs a GPU of "
                    "compute capability 8.9 or newer (its kernels convert float8_e4m3fn with "
                    "sm_89 instructions); NVIDIA A100-SXM4-80GB has 8.0: use "
                    "index_cache_dtype=int8"], r.stderr[-2000:]
  r, report = _compile(tmp_path, "--target=h200", "--programs=decode,tiered_decode", *args)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "indexer keys fp8_e4m3" in r.stdout.splitlines()[0]
  assert {p["name"] for p in report["programs"]} == {"decode", "tiered_decode"}
  assert all(p["error"] is None for p in report["programs"])
