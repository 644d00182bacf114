"""A DSA checkpoint (DeepSeek-V3.2 layout, models.testing.save_random_dsa with the default
model's tokenizer) through the CLI: `generate` and `capacity` run it, with --hisparse as
its learned indexer, and its bad inputs exit 2 with one line naming the flag or field."""

import pytest
from absl import flags
from absl import logging as absl_logging
from safetensors.numpy import load_file, save_file

from hisparse_jax.entrypoints.cli import main as cli
from models import testing

SMALL = ("--max_model_len=128", "--block_size=4", "--device_kv_gib=0.003",
         "--host_pool_gib=0.002")


@pytest.fixture(scope="module")
def dsa_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("dsa") / "ckpt"
  testing.save_random_dsa(path, "deepseek_v32", with_tokenizer=True)
  return path


def _main(command, *args):
  verbosity = absl_logging.get_verbosity()
  flags.FLAGS(["hisparse-jax", *args])
  try:
    return cli._main(["hisparse-jax", command])
  finally:
    flags.FLAGS.unparse_flags()
    absl_logging.set_verbosity(verbosity)


def _one_line(err: str) -> str:
  lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("I1")]
  assert len(lines) == 1, err
  return lines[0]


def test_generate_runs_a_dsa_checkpoint_with_its_learned_indexer(dsa_dir, capsys):
  assert _main("generate", f"--model={dsa_dir}", "--prompt=bafu: bapo\\nbaki: bare\\n? baki:",
               "--max_new_tokens=6", "--hisparse", "--hot_buffer_tokens=16", *SMALL) == 0
  out = capsys.readouterr().out
  assert "blocks selected: device" in out


def test_capacity_lists_both_caches_per_memory_kind(dsa_dir, capsys):
  assert _main("capacity", f"--model={dsa_dir}", "--hisparse", "--hot_buffer_tokens=16",
               *SMALL) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 3
  for kind, line in zip(("device", "pinned_host"), lines):
    assert line.startswith(f"KV cache capacity [memory_kind={kind}]")
    # 3 layers x (32 + 16) float32 latent; 3 indexer layers x 32 float32 keys.
    assert "(MLA latent 576 bytes per token = " in line
    assert "; indexer keys 384 bytes per token = " in line
  assert "HiSparse (learned indexer, top-k 8 tokens): indexer keys of host blocks" in lines[0]


def test_8bit_indexer_keys_generate_and_their_capacity_counts_the_scales(dsa_dir, capsys):
  assert _main("generate", f"--model={dsa_dir}", "--prompt=bafu: bapo\\nbaki: bare\\n? baki:",
               "--max_new_tokens=6", "--hisparse", "--hot_buffer_tokens=16",
               "--index_cache_dtype=fp8_e4m3", *SMALL) == 0
  assert "blocks selected: device" in capsys.readouterr().out
  assert _main("capacity", f"--model={dsa_dir}", "--hisparse", "--hot_buffer_tokens=16",
               "--index_cache_dtype=int8", *SMALL) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  for line in lines[:2]:
    # 3 indexer layers x (32 int8 values + a float32 scale)
    assert "; indexer keys 108 bytes per token = " in line
    assert "(KV float32, indexer keys int8 + float32 scales)" in line


@pytest.mark.parametrize(("args", "message"), [
    (("--hisparse", "--top_k_tokens=16"),
     "--top_k_tokens is not a setting of DSA models (deepseek_v32: the learned indexer "
     "attends index_topk=8 tokens); their HiSparse flags: --hot_buffer_tokens, "
     "--sparse_threshold_tokens"),
    (("--kv_cache_dtype=int8",),
     "--kv_cache_dtype=int8: 8-bit caches of DSA models (deepseek_v32: MLA latent + indexer "
     "keys) are not supported; use auto"),
    (("--hisparse", "--max_model_len=8"),
     "--hisparse: index_topk=8 (the model's config.json) is not below max_model_len=8: every "
     "query attends every earlier token, so HiSparse has nothing to select; raise "
     "max_model_len or run without hisparse"),
    (("--hisparse", "--hot_buffer_tokens=4"),
     "--hisparse: --hot_buffer_tokens (4) must be >= the model's index_topk (8): a step's "
     "selected tokens must fit the hot buffer at once"),
])
def test_bad_input_exits_2_with_one_line(dsa_dir, capsys, args, message):
  assert _main("generate", f"--model={dsa_dir}", "--prompt=bafu:", *SMALL[1:], *args) == 2
  assert _one_line(capsys.readouterr().err) == f"hisparse-jax generate: error: {message}"


def test_a_missing_indexer_tensor_names_it(dsa_dir, tmp_path, capsys):
  broken = tmp_path / "broken"
  broken.mkdir()
  for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
    (broken / name).write_bytes((dsa_dir / name).read_bytes())
  tensors = load_file(dsa_dir / "model.safetensors")
  name = "model.layers.1.self_attn.indexer.k_norm.bias"
  save_file({k: v for k, v in tensors.items() if k != name}, broken / "model.safetensors")
  assert _main("generate", f"--model={broken}", "--prompt=bafu:", *SMALL) == 2
  assert _one_line(capsys.readouterr().err) == (
      f"hisparse-jax generate: error: --model: missing tensor {name!r} in {broken} "
      "(1 missing in all)")


def test_convert_refuses_a_dsa_checkpoint(dsa_dir, tmp_path, capsys):
  out = tmp_path / "out"
  assert _main("convert", f"--model={dsa_dir}", f"--out={out}") == 2
  assert _one_line(capsys.readouterr().err) == (
      f"hisparse-jax convert: error: --model: {dsa_dir} is a DSA model (deepseek_v32), "
      "already in HF layout; convert writes llama-family models (from GGUF files or HF "
      "directories)")
  assert not out.exists()


def test_8bit_indexer_keys_on_a_llama_model_exit_2_naming_the_flag(capsys):
  # (the default model: hisparse-tiny, a llama)
  assert _main("generate", "--prompt=bafu:", "--index_cache_dtype=int8", *SMALL) == 2
  assert _one_line(capsys.readouterr().err) == (
      "hisparse-jax generate: error: --index_cache_dtype=int8: only DSA models (deepseek_v32, "
      "glm_moe_dsa) have an indexer-key cache; llama has none: use auto")
