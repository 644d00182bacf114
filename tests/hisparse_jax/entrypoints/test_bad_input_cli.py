"""Bad input on the command line: exit status 2 and ONE stderr line naming the flag or field.

Each row of the table below is one bad input and the exact line `hisparse-jax` prints for
it (the table of WORKSPACE.md). The rows run in this process through `cli._main` (fast:
no interpreter start, no jax import per row); a few subprocess runs check the process
boundary: the exit status, that stderr holds that one line and no traceback, and that
`--verbosity=1` adds the traceback. A checkpoint the loader refuses is reported as
`--model: <the library's message>`; the library raises a ValueError with that message
(checked here for the checkpoint rows; tests/hisparse_jax/engine/test_bad_input.py checks the
others).
"""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from absl import flags
from absl import logging as absl_logging
from safetensors.numpy import load_file, save_file

from hisparse_jax.entrypoints.cli import main as cli
from hisparse_jax.entrypoints.llm import LLM
from models.loader import CheckpointError
from models.testing import save_random_checkpoint

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
WEIGHTS = "model.safetensors"
# The random checkpoint (models.testing): 4 KiB blocks of 16 tokens, 512 positions.
SMALL = ("--max_model_len=256", "--device_kv_gib=0.001", "--host_pool_gib=0.002")


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
  return save_random_checkpoint(tmp_path_factory.mktemp("good"), seed=1)


def _edit_config(path, edit):
  raw = json.loads((path / "config.json").read_text())
  edit(raw)
  (path / "config.json").write_text(json.dumps(raw))


def _edit_tensors(path, edit):
  tensors = load_file(str(path / WEIGHTS))
  edit(tensors)
  save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})


def _truncate(path):
  data = (path / WEIGHTS).read_bytes()
  (path / WEIGHTS).write_bytes(data[:len(data) // 2])


def _wrong_shape(tensors):
  tensors["model.layers.0.self_attn.k_proj.weight"] = tensors[
      "model.layers.0.self_attn.k_proj.weight"][:8]


# Ways to break a good checkpoint, and the library's message ({d}: the directory).
BROKEN = {
    "config.json missing a field": (
        lambda d: _edit_config(d, lambda raw: raw.pop("hidden_size")),
        "{d}/config.json: config.json lacks required field(s) ['hidden_size']"),
    "unknown model_type": (
        lambda d: _edit_config(d, lambda raw: raw.update(model_type="gpt_neox")),
        "{d}/config.json: unknown model_type 'gpt_neox'; supported: llama, qwen2, mistral"),
    "safetensors missing a tensor": (
        lambda d: _edit_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
        "missing tensor 'model.layers.1.mlp.up_proj.weight' in {d} (1 missing in all)"),
    "safetensors tensor of a wrong shape": (
        lambda d: _edit_tensors(d, _wrong_shape),
        "tensor 'model.layers.0.self_attn.k_proj.weight' in {d}/model.safetensors has shape "
        "(8, 32), expected (16, 32)"),
    "safetensors truncated": (
        _truncate, re.compile(r"{d}/model\.safetensors is truncated or corrupt: \S.*")),
}


def _main_in_process(command, *flag_args):
  """`hisparse-jax COMMAND FLAGS` in this process: its exit status."""
  verbosity = absl_logging.get_verbosity()
  flags.FLAGS(["hisparse-jax", *flag_args])
  try:
    return cli._main(["hisparse-jax", command])
  finally:
    flags.FLAGS.unparse_flags()
    absl_logging.set_verbosity(verbosity)  # commands raise it to INFO


def _assert_one_line(err: str, expected) -> None:
  lines = [ln for ln in err.splitlines() if ln.strip()]
  assert len(lines) == 1, err
  if isinstance(expected, re.Pattern):
    assert expected.fullmatch(lines[0]), lines[0]
  else:
    assert lines[0] == expected


def _expect(command: str, message: str, **fmt) -> str:
  """The whole stderr line for a command's error `message`."""
  return f"hisparse-jax {command}: error: " + message.format(**fmt)


# (bad input, command, flags, message). {file}: a prompts file holding `content`.
FLAG_ROWS = [
    ("prompt longer than max_model_len", "generate", ("--prompt=bafu: bapo", "--max_model_len=3"),
     "--prompt #1: prompt has 3 tokens; max_model_len=3 leaves no room for an output token"),
    ("empty prompt", "generate", ("--prompt=bafu:", "--prompt="),
     "--prompt #2: prompt is empty"),
    ("max_tokens < 1", "generate", ("--prompt=bafu:", "--max_new_tokens=0"),
     "--max_new_tokens must be >= 1, got 0"),
    ("negative temperature", "generate", ("--prompt=bafu:", "--temperature=-0.5"),
     "--temperature must be >= 0, got -0.5"),
    ("top_p = 0", "generate", ("--prompt=bafu:", "--top_p=0"),
     "--top_p must be in (0, 1], got 0.0"),
    ("top_p > 1", "generate", ("--prompt=bafu:", "--top_p=1.5"),
     "--top_p must be in (0, 1], got 1.5"),
    ("empty stop string", "generate", ("--prompt=bafu:", "--stop="),
     "--stop strings must be non-empty strings, got ''"),
    ("negative logprobs", "generate", ("--prompt=bafu:", "--logprobs=-1"),
     "--logprobs must be >= 0 or None, got -1"),
    ("negative seed", "generate", ("--prompt=bafu:", "--seed=-1"), "--seed must be >= 0, got -1"),
    ("negative log_every_steps", "generate", ("--prompt=bafu:", "--log_every_steps=-1"),
     "--log_every_steps must be >= 0, got -1"),
    ("prometheus_port out of range", "generate", ("--prompt=bafu:", "--prometheus_port=99999"),
     "--prometheus_port must be in [1, 65535], got 99999"),
    ("metrics_json in a missing directory", "generate",
     ("--prompt=bafu:", "--metrics_json=/nonexistent/dir/m.json"),
     "--metrics_json=/nonexistent/dir/m.json: directory /nonexistent/dir does not exist"),
    ("block_size 0 (capacity)", "capacity", ("--block_size=0",),
     "--block_size must be a power of two, got 0"),
    ("port out of range", "serve", ("--port=70000",),
     "--port must be in [0, 65535], got 70000"),
    ("negative demo_seed", "demo", ("--model=hisparse-tiny", "--demo_seed=-1"),
     "--demo_seed must be >= 0, got -1"),
    ("block_size 0 (bench)", "bench", ("--suite=decode_sparse_vs_dense", "--block_size=0"),
     "--block_size must be a power of two, got 0"),
    ("n below 1", "generate", ("--prompt=bafu:", "--n=0"), "--n must be at least 1, got 0"),
    ("n > 1 greedy", "generate", ("--prompt=bafu:", "--n=3"),
     "--n must be 1 when using greedy sampling, got 3"),
    ("n above max_num_seqs", "generate",
     ("--prompt=bafu:", "--n=8", "--temperature=1", "--max_num_seqs=4"),
     "--n=8 exceeds --max_num_seqs=4 (the n completions of a prompt run together)"),
    ("top_k_tokens larger than hot_buffer_tokens", "generate",
     ("--prompt=bafu:", "--hisparse", "--top_k_tokens=64", "--hot_buffer_tokens=32"),
     "--hot_buffer_tokens (32) must be >= top_k_tokens (64): a step's selected blocks must fit "
     "the hot buffer at once"),
    ("block_size not a power of two", "generate", ("--prompt=bafu:", "--block_size=12"),
     "--block_size must be a power of two, got 12"),
    ("block_size not a power of two", "capacity", ("--block_size=12",),
     "--block_size must be a power of two, got 12"),
    ("missing model directory", "generate", ("--prompt=bafu:", "--model=/nonexistent/ckpt"),
     "--model: checkpoint directory /nonexistent/ckpt does not exist"),
    ("missing model directory", "capacity", ("--model=/nonexistent/ckpt",),
     "--model: checkpoint directory /nonexistent/ckpt does not exist"),
]

FILE_ROWS = [
    ("prompts file not UTF-8", b'{"prompt": "bafu:"}\n{"prompt": "\xff"}\n',
     "--prompts_file={file}: not UTF-8 text (byte 0xff on line 2)"),
    ("prompts file with a bad JSONL line", b'{"prompt": "bafu:"}\n\n{"prompt": "bafu:",}\n',
     "{file} line 3: not valid JSON (Expecting property name enclosed in double quotes at "
     "column 20)"),
    ("empty prompt (file)", b'{"prompt": "bafu:"}\n{"prompt": ""}\n',
     "{file} line 2: prompt is empty"),
    ("empty prompt_token_ids (file)", b'{"prompt_token_ids": []}\n',
     '{file} line 1: "prompt_token_ids" must be a non-empty list of integers'),
    ("token id outside the vocabulary", b'{"prompt_token_ids": [1, 1031]}\n',
     "{file} line 1: prompt_token_ids: token id 1031 is outside the vocabulary [0, 1031)"),
    ("negative token id", b'{"prompt": "bafu:"}\n{"prompt_token_ids": [-1, 5]}\n',
     "{file} line 2: prompt_token_ids: token id -1 is outside the vocabulary [0, 1031)"),
    ("max_tokens < 1 (file)", b'{"prompt": "bafu:", "max_tokens": 0}\n',
     '{file} line 1: "max_tokens" must be an integer >= 1, got 0'),
    ("prompt longer than max_model_len (file)",
     b'{"prompt_token_ids": [' + b", ".join([b"5"] * 2048) + b"]}\n",
     "{file} line 1: prompt has 2048 tokens; max_model_len=2048 leaves no room for an output "
     "token"),
]


@pytest.mark.parametrize("what, command, args, message", FLAG_ROWS,
                         ids=[f"{r[1]}: {r[0]}" for r in FLAG_ROWS])
def test_bad_flag_exits_2_with_one_line(what, command, args, message, capsys):
  assert _main_in_process(command, *args) == 2, what
  _assert_one_line(capsys.readouterr().err, _expect(command, message))


@pytest.mark.parametrize("what, content, message", FILE_ROWS, ids=[r[0] for r in FILE_ROWS])
def test_bad_prompts_file_exits_2_with_one_line_naming_the_line(what, content, message,
                                                                 tmp_path, capsys):
  path = tmp_path / "prompts.jsonl"
  path.write_bytes(content)
  assert _main_in_process("generate", f"--prompts_file={path}") == 2, what
  _assert_one_line(capsys.readouterr().err, _expect("generate", message, file=path))


@pytest.mark.parametrize("what", sorted(BROKEN))
def test_bad_checkpoint_exits_2_naming_model_and_the_library_raises_the_same(
    what, good_checkpoint, tmp_path, capsys):
  path = tmp_path / "ckpt"
  shutil.copytree(good_checkpoint, path)
  breaks, message = BROKEN[what]
  breaks(path)
  with pytest.raises(CheckpointError) as info:
    LLM(str(path), max_model_len=256, device_kv_gib=0.001, host_pool_gib=0.002)
  assert isinstance(info.value, ValueError)
  if isinstance(message, re.Pattern):
    library = re.compile(message.pattern.format(d=re.escape(str(path))))
  else:
    library = re.compile(re.escape(message.format(d=path)))
  assert library.fullmatch(str(info.value)), str(info.value)
  assert _main_in_process("generate", "--prompt=bafu:", f"--model={path}", *SMALL) == 2
  err = capsys.readouterr().err
  prefix = "hisparse-jax generate: error: --model: "
  _assert_one_line(err, prefix + str(info.value))


def _gguf_without(prefix):
  def edit(meta, tensors):
    for key in [k for k in meta if k.startswith(prefix)]:
      del meta[key]
  return edit


def _gguf_arch(meta, tensors):
  for key in [k for k in meta if k.startswith("llama.")]:
    meta["gpt_neox." + key[len("llama."):]] = meta.pop(key)


# Ways to break a good GGUF file (models.testing writes it as llama.cpp's converter does),
# and a part of the one line naming the file and the thing.
BROKEN_GGUF = {
    "truncated": (None, "is a truncated or corrupt GGUF file"),
    "unsupported tensor type": (
        lambda meta, tensors: tensors.update({"blk.1.ffn_up.weight": np.zeros((96, 64),
                                                                              np.int32)}),
        "blk.1.ffn_up.weight"),
    "unknown architecture": (_gguf_arch, "unknown architecture 'gpt_neox'"),
    "missing tokenizer": (_gguf_without("tokenizer.ggml"), "tokenizer.ggml.tokens"),
}


@pytest.mark.parametrize("what", sorted(BROKEN_GGUF))
def test_bad_gguf_exits_2_naming_the_file_and_the_thing(what, tmp_path, capsys):
  from models import testing  # noqa: PLC0415
  from models.config import ModelConfig  # noqa: PLC0415

  config = ModelConfig(model_type="llama", vocab_size=512, hidden_size=64,
                       intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, rms_norm_eps=2.0 ** -17,
                       rope_theta=10000.0, max_position_embeddings=512, bos_token_id=1,
                       eos_token_id=2, pad_token_id=0)
  model, tokenizer = testing.random_model(config), testing.byte_level_tokenizer(512)
  arch, meta, tensors = testing.gguf_contents(model, tokenizer)
  edit, part = BROKEN_GGUF[what]
  meta, tensors = dict(meta), dict(tensors)
  if edit is not None:
    edit(meta, tensors)
  path = testing.write_gguf(tmp_path / "model.gguf", "gpt_neox" if edit is _gguf_arch
                            else arch, meta, tensors)
  if edit is None:
    data = open(path, "rb").read()
    with open(path, "wb") as f:
      f.write(data[:len(data) // 2])
  with pytest.raises(CheckpointError) as info:
    LLM(str(path), max_model_len=256, device_kv_gib=0.001, host_pool_gib=0.002)
  assert str(path) in str(info.value) and part in str(info.value), str(info.value)
  assert _main_in_process("generate", "--prompt=hi", f"--model={path}", *SMALL) == 2
  _assert_one_line(capsys.readouterr().err,
                   "hisparse-jax generate: error: --model: " + str(info.value))


def test_capacity_refusals_name_the_flag(good_checkpoint, capsys):
  # A host pool above 95% of the available RAM.
  assert _main_in_process("generate", "--prompt=bafu:", f"--model={good_checkpoint}",
                          "--max_model_len=256", "--host_pool_gib=100000") == 2
  _assert_one_line(capsys.readouterr().err, re.compile(
      r"hisparse-jax generate: error: --host_pool_gib=100000\.0 asks for 100,000\.00 GiB of "
      r"pinned host memory, above 95% of the available RAM \(\d+\.\d\d GiB available, at most "
      r"\d+\.\d\d GiB\)"))
  # A device budget that cannot hold one request of --max_model_len: 107,374 bytes are
  # 26 blocks of 4 KiB, one of them the null block; 512 tokens need 32.
  assert _main_in_process("capacity", f"--model={good_checkpoint}", "--max_model_len=512",
                          "--device_kv_gib=0.0001", "--block_size=16") == 2
  _assert_one_line(capsys.readouterr().err, (
      "hisparse-jax capacity: error: --device_kv_gib: the device KV budget of 107,374 bytes = "
      "0.10 MiB (--device_kv_gib) holds 25 usable blocks after the null block and 0 bytes "
      "reserved for the indexer and hot buffers, but one request of --max_model_len=512 "
      "tokens needs 32 blocks of 16 tokens (131,072 bytes); raise --device_kv_gib or lower "
      "--max_model_len"))
  # HiSparse: the key bounds of every host block (256 bytes per 1 KiB block of 4 tokens)
  # come out of the device budget; the line names the host pool too. (A chunk given: left
  # to the engine, a smaller one streams the request through this budget instead.)
  assert _main_in_process("capacity", f"--model={good_checkpoint}", "--max_model_len=256",
                          "--device_kv_gib=0.0003", "--host_pool_gib=0.002", "--block_size=4",
                          "--hisparse", "--max_num_batched_tokens=2048") == 2
  _assert_one_line(capsys.readouterr().err, (
      "hisparse-jax capacity: error: --device_kv_gib: the device KV budget of 322,122 bytes = "
      "0.31 MiB (--device_kv_gib) holds 63 usable blocks after the null block and 255,563 "
      "bytes reserved for the indexer and hot buffers, but one request of --max_model_len=256 "
      "tokens needs 64 blocks of 4 tokens (65,536 bytes); raise --device_kv_gib or lower "
      "--max_model_len (or lower --host_pool_gib, raise --block_size or set "
      "--bounds_dtype=int8: the indexer keeps the key bounds of every host block on the "
      "device)"))


def test_unknown_command_and_flag(capsys):
  assert cli._main(["hisparse-jax", "frobnicate"]) == 2
  _assert_one_line(capsys.readouterr().err, (
      f"hisparse-jax: unknown command 'frobnicate'; choose one of: "
      f"{', '.join(sorted(cli.COMMANDS))}"))
  with pytest.raises(SystemExit) as info:
    cli._parse_flags(["hisparse-jax", "generate", "--no_such_flag=1"])
  flags.FLAGS.unparse_flags()
  assert info.value.code == 2
  _assert_one_line(capsys.readouterr().err,
                   "hisparse-jax: error: Unknown command line flag 'no_such_flag'")


def _subprocess(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "hisparse_jax", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=120)


def test_process_exits_2_with_one_line_and_no_traceback(good_checkpoint, tmp_path):
  path = tmp_path / "ckpt"
  shutil.copytree(good_checkpoint, path)
  _edit_tensors(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  r = _subprocess("generate", "--prompt=bafu:", f"--model={path}", *SMALL)
  assert r.returncode == 2 and "Traceback" not in r.stderr
  _assert_one_line(r.stderr, f"hisparse-jax generate: error: --model: missing tensor "
                             f"'model.layers.1.mlp.up_proj.weight' in {path} (1 missing in all)")
  assert r.stdout == ""


def test_serve_bad_port_is_the_only_line():
  # (checked before the engine flags, whose check logs the compilation cache's line)
  r = _subprocess("serve", "--port=99999")
  assert r.returncode == 2 and "Traceback" not in r.stderr
  _assert_one_line(r.stderr, "hisparse-jax serve: error: --port must be in [0, 65535], got 99999")


def test_verbosity_1_adds_the_traceback_and_still_exits_2(tmp_path):
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_bytes(b'{"prompt_token_ids": [1, 1031]}\n')
  r = _subprocess("generate", f"--prompts_file={prompts}", "--verbosity=1")
  assert r.returncode == 2
  assert "Traceback (most recent call last)" in r.stderr
  lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
  assert lines[-1] == (f"hisparse-jax generate: error: {prompts} line 1: prompt_token_ids: "
                       "token id 1031 is outside the vocabulary [0, 1031)")


def test_unknown_kv_cache_dtype_exits_2_naming_the_flag(good_checkpoint, capsys):
  with pytest.raises(SystemExit) as info:
    cli._parse_flags(["hisparse-jax", "generate", "--kv_cache_dtype=int4"])
  flags.FLAGS.unparse_flags()
  assert info.value.code == 2
  _assert_one_line(capsys.readouterr().err, (
      "hisparse-jax: error: flag --kv_cache_dtype=int4: value should be one of "
      "<auto|int8|fp8_e4m3>"))
  # int8 and fp8_e4m3 plan and report both tiers.
  for name in ("int8", "fp8_e4m3"):
    assert _main_in_process("capacity", f"--model={good_checkpoint}",
                            f"--kv_cache_dtype={name}", "--max_model_len=256",
                            "--device_kv_gib=0.001", "--host_pool_gib=0.002") == 0
    out = capsys.readouterr().out
    assert out.count(f"(KV {name} + float32 scales)") == 2
