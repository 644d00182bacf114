"""`hisparse-jax convert` end to end, in a subprocess: a tiny random GGUF -> an HF directory
that loads back with the same logits; bad --out values exit 2 with one line naming the flag
(before the model loads)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from hisparse_jax.entrypoints.cli import convert as convert_cmd
from models import testing
from models.config import ModelConfig
from models.loader import load_pretrained

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def _run(*flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "hisparse_jax", "convert", *flags], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
  config = ModelConfig(model_type="llama", vocab_size=320, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)
  path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
  return testing.save_gguf(testing.random_model(config, seed=3), path,
                           testing.byte_level_tokenizer(320))


def test_convert_writes_a_directory_that_loads_back(gguf_file, tmp_path):
  out = tmp_path / "a" / "hf"  # parents are made
  r = _run(f"--model={gguf_file}", f"--out={out}")
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith(f"wrote {out}: llama, 2 layers, ") and "in float32" in r.stdout
  ours, _, tok = load_pretrained(gguf_file)
  back, _, back_tok = load_pretrained(out)
  ids = np.asarray([tok.encode("The quick brown fox jumps over the lazy dog.")])
  assert back_tok.encode("The quick brown fox") == tok.encode("The quick brown fox")
  positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
  np.testing.assert_array_equal(np.asarray(back(ids, positions)[0]),
                                np.asarray(ours(ids, positions)[0]))


def test_bad_out_exits_2_with_one_line(gguf_file, tmp_path):
  full = tmp_path / "full"
  full.mkdir()
  (full / "x").write_text("x")
  a_file = tmp_path / "file"
  a_file.write_text("x")
  cases = [
      ((), "--out is required: the directory to write the checkpoint into"),
      ((f"--out={full}",), f"--out={full}: directory exists and is not empty (give a new or "
                           "empty directory)"),
      ((f"--out={a_file}",), f"--out={a_file}: exists and is not a directory"),
      ((f"--out={a_file}/sub",), f"--out={a_file}/sub: {a_file} is not a directory"),
  ]
  for flags, message in cases:
    r = _run(f"--model={gguf_file}", *flags)
    assert r.returncode == 2, (flags, r.stderr)
    assert r.stderr == f"hisparse-jax convert: error: {message}\n", flags
  assert os.listdir(full) == ["x"]
  r = _run("--model=/nonexistent/m.gguf", f"--out={tmp_path / 'new'}")
  assert (r.returncode, r.stderr) == (2, "hisparse-jax convert: error: --model: GGUF file "
                                         "/nonexistent/m.gguf does not exist\n")
  r = _run(f"--model={gguf_file}", f"--out={tmp_path / 'new'}", "--max_model_len=64")
  assert r.returncode == 2 and "--max_model_len is not a flag of convert" in r.stderr


def test_unwritable_out_names_the_flag(tmp_path, monkeypatch):
  """(In process: the tests may run as root, for whom every directory is writable.)"""
  monkeypatch.setattr(convert_cmd.os, "access", lambda path, mode: False)
  with pytest.raises(ValueError, match=f"^--out={tmp_path}/new: directory {tmp_path} is not "
                                       "writable$"):
    convert_cmd.check_out(f"{tmp_path}/new")
