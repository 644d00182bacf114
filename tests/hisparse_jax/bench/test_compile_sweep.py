"""The deviceless compile sweep (hisparse_jax/bench/compile_sweep.py): its configs cover
each geometry on both GPU backends, and one runs end to end through `hisparse-jax compile`
(the full sweep, ~45 + ~20 min, is a bench: WORKSPACE "compile sweep")."""

import importlib.util

import pytest

from hisparse_jax.bench import compile_sweep

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
    reason="XLA's GPU compiler is not installed (jax[cuda13]; make setup installs it)")


def test_the_configs_cover_every_geometry_on_both_backends(tmp_path):
  labels = [label for label, _ in compile_sweep.llama_runs(str(tmp_path), "mha64")]
  assert len(labels) == 12
  assert {label.split()[1] for label in labels} == {"pallas", "pallas_mgpu"}
  assert sum("hisparse=1" in label for label in labels) == 6
  assert compile_sweep.main(["compile_sweep", "gpt"]) == 2


def test_one_config_compiles_through_the_cli(tmp_path, capsys):
  (result,) = compile_sweep.run("llama", "gqa4_80", str(tmp_path), limit=1)
  assert result["rc"] == 0, result
  assert "gqa4_80" in capsys.readouterr().out
