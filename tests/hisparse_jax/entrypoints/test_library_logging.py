"""A library user sees the capacity lines at model load (as vLLM's users see its INFO
lines), without an absl app; HISPARSE_CONFIGURE_LOGGING=0 leaves logging alone."""

import os
import subprocess
import sys

SCRIPT = ("from hisparse_jax import LLM\n"
          "LLM(device_kv_gib=0.01, host_pool_gib=0.01, max_model_len=256)\n")


def _run(**env):
  return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                        timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu", **env})


def test_llm_logs_the_capacity_of_each_memory_kind():
  r = _run()
  assert r.returncode == 0, r.stderr
  lines = [ln for ln in r.stderr.splitlines() if "KV cache capacity" in ln]
  assert [ln.split("[")[1].split("]")[0] for ln in lines] == [
      "memory_kind=device", "memory_kind=pinned_host", "total"]
  assert "Unable to initialize backend" not in r.stderr


def test_configure_logging_off_leaves_it_alone():
  r = _run(HISPARSE_CONFIGURE_LOGGING="0")
  assert r.returncode == 0, r.stderr
  assert "KV cache capacity" not in r.stderr
