"""`hisparse-jax generate` end to end, in subprocesses (stdout: answers; stderr: absl logs)."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from models import data
from models.testing import save_random_checkpoint

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
# 2 layers x 1 KV head x 16 dims x 4 bytes x (K, V) = 256 bytes per token.
SMALL_POOLS = ("--device_kv_gib=0.0005", "--host_pool_gib=0.001", "--max_model_len=64",
               "--max_num_batched_tokens=32", "--max_num_seqs=4")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A random 2-layer Llama over the default model's vocabulary, in HF layout."""
  return save_random_checkpoint(tmp_path_factory.mktemp("tiny_cli"), seed=5)


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  """A persistent JAX compilation cache shared by this module's runs (halves the second)."""
  return str(tmp_path_factory.mktemp("jax_cache"))


def _generate(*args, cache_dir=None):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if cache_dir:
    env.update(JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return subprocess.run([sys.executable, "-m", "hisparse_jax", "generate", *args], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=180)


def _one_error_line(r) -> str:
  assert r.returncode == 2, r.stderr
  lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
  assert len(lines) == 1, r.stderr
  assert "Traceback" not in r.stderr
  return lines[0]


def test_prompt_flags_then_prompts_file_with_expected_answers(checkpoint, compile_cache,
                                                               tmp_path):
  # 1. Two --prompt flags: one line per prompt, in order, with the output text as JSON,
  # each followed by its tokens' logprobs (--logprobs=1: the token's, and the most likely
  # other token's where the token is not the most likely).
  r = _generate(f"--model={checkpoint}", *SMALL_POOLS, "--max_new_tokens=3",
                "--prompt=bafu: bapo\nbaki: bare\n? baki:", "--prompt=baki:", "--logprobs=1",
                cache_dir=compile_cache)
  assert r.returncode == 0, r.stderr
  lines = r.stdout.splitlines()
  m0 = re.fullmatch(r'\[0\] (".*") \(9 prompt tokens, (\d) generated, finish (\w+)\)', lines[0])
  m1 = re.fullmatch(r'\[1\] (".*") \(2 prompt tokens, (\d) generated, finish (\w+)\)', lines[2])
  assert m0 and m1, r.stdout
  token = r"'[^']*' -?\d+\.\d{3}( \['[^']*' -?\d+\.\d{3}\])?"
  for line, m in ((lines[1], m0), (lines[3], m1)):
    pattern = rf"    logprobs \(sum -?\d+\.\d{{3}}\): {token}( \| {token})*"
    assert re.fullmatch(pattern, line), line
    assert line.count(" | ") == int(m.group(2)) - 1
  assert "KV cache capacity [memory_kind=pinned_host]" in r.stderr
  assert lines[4] == "metrics:"
  answer = json.loads(m0.group(1)).split("\n")[0].strip()

  # 2. The same prompt from a file, expected = that answer (RIGHT) and a wrong one; a
  # token-id prompt with its own max_tokens; a blank line is skipped.
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("\n".join([
      json.dumps({"prompt": "bafu: bapo\nbaki: bare\n? baki:", "expected": answer}),
      json.dumps({"prompt": "bafu: bapo\nbaki: bare\n? baki:", "expected": "zzz"}),
      "",
      json.dumps({"prompt_token_ids": [data.BOS_ID, 600, 601, 4], "max_tokens": 2}),
  ]) + "\n")
  metrics_json = tmp_path / "metrics.json"
  r = _generate(f"--model={checkpoint}", *SMALL_POOLS, "--max_new_tokens=3",
                f"--prompts_file={prompts}", f"--metrics_json={metrics_json}",
                "--log_every_steps=1", cache_dir=compile_cache)
  assert r.returncode == 0, r.stderr
  lines = r.stdout.splitlines()
  assert lines[0].startswith(f"[0] RIGHT {answer!r} (expected {answer!r}; 9 prompt tokens")
  assert lines[1].startswith(f"[1] WRONG {answer!r} (expected 'zzz'; 9 prompt tokens")
  assert re.match(r'\[2\] ".*" \(4 prompt tokens, 2 generated, finish length\)', lines[2])
  assert lines[3] == "1/2 right"
  summary = "\n".join(lines[4:])
  for needle in ("requests: 3 finished", "generated tokens/s", "time to first token: p50",
                 "preemptions (swap-out to the host pool): 0", "blocks selected: device",
                 "transfers: h2d 0.00 MiB, d2h 0.00 MiB"):
    assert needle in summary
  assert re.search(r"step 1: running \d, swapped 0, waiting \d reqs; KV usage device", r.stderr)
  metrics = json.loads(metrics_json.read_text())
  generated = sum(int(re.search(r"(\d) generated", ln).group(1)) for ln in lines[:3])
  assert metrics["hisparse_generation_tokens_total"] == generated
  assert metrics["hisparse_prompt_tokens_total"] == 9 + 9 + 4
  assert metrics['hisparse_kv_capacity_tokens{memory_kind="device"}'] > 0
  assert metrics['hisparse_blocks_selected_total{source="device"}'] > 0
  assert metrics['hisparse_blocks_selected_total{source="host"}'] == 0


@pytest.mark.parametrize("content,needle", [
    (b'{"prompt": "bafu:"}\n{"prompt": "bafu:",}\n', r"prompts.jsonl line 2: not valid JSON"),
    (b'{"prompt": "bafu:"}\n\n{"promt": "x"}\n', r"prompts.jsonl line 3: unknown field 'promt'"),
    (b'{"prompt_token_ids": [1, "a"]}\n', r"line 1: \"prompt_token_ids\" must be a non-empty"),
    (b'{"prompt": "bafu:", "max_tokens": 0}\n', r"line 1: \"max_tokens\" must be an integer"),
    (b'{"prompt": "bafu:"}\n{"prompt": "\xff"}\n', r"not UTF-8 text \(byte 0xff on line 2\)"),
])
def test_bad_prompts_file_exits_2_naming_the_line(tmp_path, content, needle):
  path = tmp_path / "prompts.jsonl"
  path.write_bytes(content)
  line = _one_error_line(_generate(f"--prompts_file={path}"))
  assert line.startswith("hisparse-jax generate: error: ")
  assert re.search(needle, line), line


def test_no_prompts_and_bad_sampling_flag_exit_2():
  assert "no prompts: give --prompt" in _one_error_line(_generate())
  line = _one_error_line(_generate("--prompt=bafu:", "--max_new_tokens=0"))
  assert "--max_new_tokens must be >= 1, got 0" in line


def test_busy_prometheus_port_is_refused_naming_the_flag(checkpoint):
  from hisparse_jax.engine.sampling import SamplingParams  # noqa: PLC0415
  from hisparse_jax.entrypoints.cli import generate as generate_cmd  # noqa: PLC0415

  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    spec = generate_cmd.PromptSpec(source="test", prompt="bafu:")
    kwargs = dict(model=checkpoint, device_kv_gib=0.0005, host_pool_gib=0.001,
                  max_model_len=64)
    with pytest.raises(ValueError, match=f"--prometheus_port={port}: .*in use"):
      generate_cmd.run([spec], kwargs, SamplingParams(temperature=0.0), prometheus_port=port)


def test_answer_is_the_first_line():
  from hisparse_jax.entrypoints.cli.generate import answer_of  # noqa: PLC0415

  assert answer_of(" lodu \n bafu: moti") == "lodu"
  assert answer_of("lodu") == "lodu"
  assert answer_of("\nlodu") == ""


def test_n_completions_print_a_line_each(checkpoint):
  """--n=3: three lines [prompt.k] per prompt, each checked against its expected answer."""
  import io  # noqa: PLC0415

  from hisparse_jax.engine.sampling import SamplingParams  # noqa: PLC0415
  from hisparse_jax.entrypoints.cli import generate as generate_cmd  # noqa: PLC0415

  specs = [generate_cmd.PromptSpec(source="test", prompt="bafu: bapo\nbaki: bare\n? baki:",
                                   expected="bare"),
           generate_cmd.PromptSpec(source="test", prompt="baki:")]
  kwargs = dict(model=checkpoint, device_kv_gib=0.0005, host_pool_gib=0.001, max_model_len=64)
  out = io.StringIO()
  result = generate_cmd.run(specs, kwargs, SamplingParams(temperature=1.0, n=3, max_tokens=3,
                                                          seed=1), out=out)
  lines = out.getvalue().splitlines()
  assert [ln.split(" ")[0] for ln in lines[:6]] == ["[0.0]", "[0.1]", "[0.2]", "[1.0]", "[1.1]",
                                                    "[1.2]"]
  assert all(re.match(r"\[0\.\d\] (RIGHT|WRONG) .* \(expected 'bare'; 9 prompt", ln)
             for ln in lines[:3])
  assert lines[6] == f"{result.num_right}/3 right"
  assert [len(o.outputs) for o in result.outputs] == [3, 3]
  # One prefill per prompt: the prompt tokens are counted once.
  assert result.metrics["hisparse_prompt_tokens_total"] == 9 + 2
  assert result.metrics["hisparse_generation_tokens_total"] == sum(
      len(c.token_ids) for o in result.outputs for c in o.outputs)


def test_prompt_escapes_are_decoded():
  from hisparse_jax.entrypoints.cli.generate import decode_escapes  # noqa: PLC0415

  assert decode_escapes(r"bafu: bapo\n? bafu:") == "bafu: bapo\n? bafu:"
  assert decode_escapes(r"a\tb\\nc") == "a\tb\\nc"  # \\ is one backslash, then a plain n
  assert decode_escapes(r"a\qb\\") == r"a\qb" + "\\"  # other escapes stay as written


def test_unknown_words_warning_counts_and_names_the_first_few():
  import models  # noqa: PLC0415
  from hisparse_jax.entrypoints.cli.generate import unknown_words_warning  # noqa: PLC0415
  from models.tokenizer import Tokenizer  # noqa: PLC0415

  tok = Tokenizer.from_dir(models.DEFAULT_MODEL_DIR)
  assert unknown_words_warning(tok, [data.EXAMPLE_PROMPT], default_model=True) is None
  line = unknown_words_warning(tok, ["one two three bafu:", "four five six"],
                               default_model=True)
  assert line == (
      "hisparse-jax: warning: 6 word(s) of the prompts are not in the model's vocabulary and "
      "become <unk>: 'one', 'two', 'three', 'four', 'five' (first 5 shown); the default model "
      "answers 'key: value' lines and a '? key:' query in its own words, e.g. "
      "--prompt='bafu: bapo\\nbaki: bare\\n? baki:' (answer: bare)")
  line = unknown_words_warning(tok, ["hello bafu:"], default_model=False)
  assert line == ("hisparse-jax: warning: 1 word(s) of the prompts are not in the model's "
                  "vocabulary and become <unk>: 'hello'")


def test_escaped_newlines_and_one_unknown_words_warning(checkpoint, compile_cache):
  # '\n' typed inside --prompt='...' is a newline: 6 tokens (<bos> bafu: bapo \n ? bafu:),
  # not 4 with 'bapo\n?' as one unknown word. Unknown words: ONE warning line for all.
  r = _generate(f"--model={checkpoint}", *SMALL_POOLS, "--max_new_tokens=1",
                r"--prompt=bafu: bapo\n? bafu:", "--prompt=hello bafu: world",
                "--prompt=hello", cache_dir=compile_cache)
  assert r.returncode == 0, r.stderr
  assert r.stdout.splitlines()[0].endswith("(6 prompt tokens, 1 generated, finish length)")
  warnings = [ln for ln in r.stderr.splitlines() if "warning" in ln]
  assert warnings == ["hisparse-jax: warning: 3 word(s) of the prompts are not in the model's "
                      "vocabulary and become <unk>: 'hello', 'world', 'hello'"], r.stderr


def test_hisparse_at_the_default_flags_decodes_long_requests_sparse(tmp_path):
  # --hisparse alone at max_model_len 2,048: top-k 512, hot buffer and threshold 1,024
  # tokens (they were 2,048 / 4,096: no request ever decoded sparse). A request decoding
  # past 1,024 tokens is a sparse decoder: its full blocks are written through to the
  # host pool (device -> host bytes, none in a dense run with room on the device).
  (prompt,) = data.make_retrieval_prompts(1, 1030, seed=5)
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text(json.dumps({"prompt": prompt.text, "expected": prompt.answer}) + "\n")
  metrics_json = tmp_path / "m.json"
  r = _generate("--hisparse", f"--prompts_file={prompts}", "--max_new_tokens=24",
                f"--metrics_json={metrics_json}", "--host_pool_gib=0.125")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "1/1 right" in r.stdout
  assert "top-k 32 blocks" in r.stderr and "HiSparse runs" in r.stderr  # blocks of 16
  m = json.loads(metrics_json.read_text())
  assert m['hisparse_transfer_bytes_total{direction="d2h"}'] > 0


def test_chat_renders_each_prompt_through_the_chat_template(tmp_path):
  """--chat: a text prompt is one user message rendered by the model's chat template and
  tokenized without special tokens again (LLM.chat's rendering); a model without a chat
  template is refused naming the flag."""
  from hisparse_jax.entrypoints.cli import generate as generate_cmd  # noqa: PLC0415
  from models import testing  # noqa: PLC0415
  from models.config import ModelConfig  # noqa: PLC0415
  from models.loader import load_tokenizer  # noqa: PLC0415

  config = ModelConfig(model_type="llama", vocab_size=512, hidden_size=64,
                       intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)
  model, tokenizer = testing.random_model(config), testing.byte_level_tokenizer(512)
  path = testing.save_gguf(model, tmp_path / "chat.gguf", tokenizer)
  spec = generate_cmd.PromptSpec(source="--prompt #1", prompt="hi there")
  (ids,) = generate_cmd.checked_prompt_ids([spec], str(path), 512, chat=True)
  tok = load_tokenizer(path)
  text = tok.apply_chat_template([{"role": "user", "content": "hi there"}],
                                 add_generation_prompt=True)
  assert text.endswith("<|im_start|>assistant\n") and "hi there" in text
  assert ids == tok.encode(text, add_special_tokens=False) != tok.encode("hi there")
  plain = testing.save_gguf(model, tmp_path / "plain.gguf", tokenizer, chat_template=None)
  with pytest.raises(ValueError, match="^--chat: the model has no chat template$"):
    generate_cmd.checked_prompt_ids([spec], str(plain), 512, chat=True)
