"""Several API keys, and the cache salt by API key (#53): `serve --api_key=K1,K2`,
`--api_keys_file`, `--cache_salt_by_api_key`.

Under the flag, two tenants (two keys) sending the same prompt share no prefix-cache
block and get the same greedy tokens; one tenant's repeated prompt still hits; the
body's cache_salt splits a tenant's cache further; the engine sees a digest, never the
key. Without the flag the keys share the cache as unsalted requests do. A wrong key is
a 401. The server runs in-process (fastapi's TestClient over `build_app`, as
test_cache_salt_serve.py); the flags are checked through `cli._main` and, end to end,
one `serve` subprocess with a keys file."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import numpy as np
import pytest
from absl import flags
from absl import logging as absl_logging
from fastapi.testclient import TestClient

from hisparse_jax.bench.serve_load import ServerProcess
from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.entrypoints import openai_auth
from hisparse_jax.entrypoints.async_engine import AsyncEngine
from hisparse_jax.entrypoints.cli import main as cli
from hisparse_jax.entrypoints.openai_server import build_app
from models import data
from models.testing import save_random_checkpoint

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
BLOCK_SIZE = 16
MODEL = "tiny"
KEYS = ("key-alice", "key-bob")
# test_cache_salt_serve's sizes: 64 device blocks, 128 host blocks of 16 tokens.
FIELDS = dict(block_size=BLOCK_SIZE, device_kv_gib=65 * 4096 / 2**30,
              host_pool_gib=129 * 4096 / 2**30, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=32)
HIT = (40 - 1) // BLOCK_SIZE * BLOCK_SIZE  # a 40-token prompt: 2 blocks (the last token computed)


def _prompt(seed: int) -> list[int]:
  """40 token ids no other test's prompt starts with."""
  return [data.BOS_ID] + np.random.default_rng(seed).choice(data.CONTENT_IDS, 39).tolist()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
  checkpoint = save_random_checkpoint(tmp_path_factory.mktemp("cache_salt_key"), seed=3)
  engine = Engine(EngineConfig(model=checkpoint, **FIELDS))
  async_engine = AsyncEngine(engine)
  async_engine.start()
  salts = []  # every cache_salt the engine is given
  add_request = engine.add_request

  def recording_add_request(*args, cache_salt=None, **kwargs):
    salts.append(cache_salt)
    return add_request(*args, cache_salt=cache_salt, **kwargs)

  engine.add_request = recording_add_request
  yield async_engine, engine, salts
  async_engine.shutdown()


@pytest.fixture(scope="module")
def salted(engine):
  async_engine, _, _ = engine
  app = build_app(async_engine, MODEL, max_model_len=FIELDS["max_model_len"], api_keys=KEYS,
                  cache_salt_by_api_key=True)
  with TestClient(app) as client:
    yield client


@pytest.fixture(scope="module")
def shared(engine):
  async_engine, _, _ = engine
  app = build_app(async_engine, MODEL, max_model_len=FIELDS["max_model_len"], api_keys=KEYS)
  with TestClient(app) as client:
    yield client


def _hits(engine) -> int:
  """Prefix-cache block hits so far, both pools (counted at admission)."""
  bm = engine.block_manager
  return bm.device_pool.prefix_cache_hits + bm.host_pool.prefix_cache_hits


def _complete(client, engine, key: str, body: dict,
              route: str = "/v1/completions") -> tuple[str, int]:
  """The answer's text (the raw SSE text for a stream) and the prompt tokens it took
  from the prefix cache."""
  before = _hits(engine[1])
  r = client.post(route, headers={"Authorization": f"Bearer {key}"},
                  json={"model": MODEL, "max_tokens": 3, "temperature": 0.0, **body})
  assert r.status_code == 200, r.text
  if body.get("stream"):
    text = r.text
  elif route == "/v1/completions":
    text = r.json()["choices"][0]["text"]
  else:
    text = r.json()["choices"][0]["message"]["content"]
  return text, (_hits(engine[1]) - before) * BLOCK_SIZE


def test_two_keys_share_no_cache_and_each_key_hits_its_own(salted, engine):
  prompt = {"prompt": _prompt(101)}
  alice, cached = _complete(salted, engine, KEYS[0], prompt)
  assert cached == 0
  # (key, prompt tokens from the prefix cache): bob misses alice's blocks, then hits his own
  for key, expected in ((KEYS[1], 0), (KEYS[0], HIT), (KEYS[1], HIT)):
    text, cached = _complete(salted, engine, key, prompt)
    assert cached == expected, key
    assert text == alice, key  # the same greedy tokens whoever computed the KV
  stream, cached = _complete(salted, engine, KEYS[1], {**prompt, "stream": True})
  assert cached == HIT and stream.rstrip().endswith("data: [DONE]")
  assert not engine[1].has_unfinished_requests()


def test_the_body_salt_splits_a_tenant_and_never_reaches_another(salted, engine):
  prompt = {"prompt": _prompt(102)}
  base, cached = _complete(salted, engine, KEYS[0], prompt)
  assert cached == 0
  # (key, body cache_salt, prompt tokens from the prefix cache)
  for key, salt, expected in ((KEYS[0], "s", 0), (KEYS[0], "s", HIT), (KEYS[1], "s", 0),
                              (KEYS[1], None, 0), (KEYS[0], None, HIT), (KEYS[1], "s", HIT)):
    text, cached = _complete(salted, engine, key, prompt if salt is None else
                             {**prompt, "cache_salt": salt})
    assert cached == expected, (key, salt)
    assert text == base, (key, salt)


def test_chat_is_salted_by_key_too(salted, engine):
  content = engine[1].tokenizer.decode(_prompt(103)[1:])
  body = {"messages": [{"role": "user", "content": content}]}
  route = "/v1/chat/completions"
  answer, cached = _complete(salted, engine, KEYS[0], body, route)
  assert cached == 0
  for key, hit in ((KEYS[1], False), (KEYS[0], True), (KEYS[1], True)):
    text, cached = _complete(salted, engine, key, body, route)
    assert (cached > 0) == hit and text == answer, key


def test_the_engine_sees_a_digest_never_the_key(salted, engine):
  _, _, salts = engine
  _complete(salted, engine, KEYS[0], {"prompt": _prompt(104), "cache_salt": "body"})
  salt = salts[-1]
  assert salt == openai_auth.cache_salt(openai_auth.ApiKeys([KEYS[0]]).key_salt(KEYS[0]),
                                        "body")
  assert salt.startswith("key-") and salt.endswith(":body") and len(salt) == 4 + 32 + 5
  for key in KEYS:
    assert all(s is None or key not in s for s in salts)
  # the same key gives the same salt in any process (a shared disk or remote tier)
  assert openai_auth.ApiKeys(KEYS).key_salt(KEYS[0]) == salt.split(":")[0]


def test_without_the_flag_every_key_shares_the_unsalted_cache(shared, engine):
  prompt = {"prompt": _prompt(105)}
  first, cached = _complete(shared, engine, KEYS[0], prompt)
  assert cached == 0
  text, cached = _complete(shared, engine, KEYS[1], prompt)
  assert cached == HIT and text == first
  assert engine[2][-1] is None  # (no salt reaches the engine)


@pytest.mark.parametrize("fixture", ["salted", "shared"])
def test_a_missing_or_wrong_key_is_a_401(fixture, request, engine):
  client = request.getfixturevalue(fixture)
  body = {"model": MODEL, "prompt": _prompt(106), "max_tokens": 2}
  for headers in ({}, {"Authorization": "Bearer key-carol"},
                  {"Authorization": f"Bearer {KEYS[0]}x"}, {"Authorization": KEYS[0]},
                  {"Authorization": f"Bearer {KEYS[0][:-1]}"}):
    r = client.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 401, (headers, r.text)
    assert r.json()["error"] == {
        "message": "invalid or missing API key (Authorization: Bearer KEY)",
        "type": "AuthenticationError", "param": None, "code": 401}
  for key in KEYS:  # every key opens the dashboard, as the header or ?token=
    assert client.get("/dashboard", params={"token": key}).status_code == 200
  for token in ("key-carol", "é"):  # (a token outside ASCII: a 401 too, not a 500)
    assert client.get("/dashboard", params={"token": token}).status_code == 401
  assert not engine[1].has_unfinished_requests()


def test_the_flag_without_keys_is_refused_by_build_app(engine):
  with pytest.raises(ValueError, match="^cache_salt_by_api_key needs api_keys"):
    build_app(engine[0], MODEL, max_model_len=64, cache_salt_by_api_key=True)
  with pytest.raises(ValueError, match="^API key 2 is empty$"):
    build_app(engine[0], MODEL, max_model_len=64, api_keys=["a", ""])
  with pytest.raises(TypeError, match="^API keys must be a list of keys, got one str$"):
    build_app(engine[0], MODEL, max_model_len=64, api_keys="key-alice")


# --- the flags -----------------------------------------------------------------------------


def test_keys_from_flags_reads_the_list_and_the_file(tmp_path):
  path = tmp_path / "keys"
  path.write_bytes(b"\xef\xbb\xbf# tenants\r\nkey-carol\r\n\r\n  key-dave  \n#key-eve\n")
  assert openai_auth.keys_from_flags(" key-alice , key-bob", str(path)) == [
      "key-alice", "key-bob", "key-carol", "key-dave"]
  assert openai_auth.keys_from_flags("k", None) == ["k"]
  assert openai_auth.keys_from_flags(None, None) == []


def _main_in_process(*flag_args) -> int:
  """`hisparse-jax serve FLAGS` in this process: its exit status."""
  verbosity = absl_logging.get_verbosity()
  flags.FLAGS(["hisparse-jax", *flag_args])
  try:
    return cli._main(["hisparse-jax", "serve"])
  finally:
    flags.FLAGS.unparse_flags()
    absl_logging.set_verbosity(verbosity)


@pytest.mark.parametrize("args, message", [
    (("--cache_salt_by_api_key",),
     "--cache_salt_by_api_key needs API keys to derive each request's salt from: give "
     "--api_key or --api_keys_file"),
    (("--api_key=",), "--api_key: the key is empty (give KEY or KEY1,KEY2,...)"),
    (("--api_key=a,,b",), "--api_key: key 2 is empty (give KEY or KEY1,KEY2,...)"),
    (("--api_key=a,b c",), "--api_key: key 2 has a space or a character outside printable "
     "ASCII (give KEY or KEY1,KEY2,...)"),
    (("--api_keys_file={missing}",),
     "--api_keys_file: cannot read {missing}: No such file or directory"),
    (("--api_keys_file={comments}", "--cache_salt_by_api_key"),
     "--api_keys_file: {comments} holds no key (one key a line; blank lines and # comments "
     "are skipped)"),
    (("--api_keys_file={spaced}",),
     "--api_keys_file: {spaced} line 2: the key has a space or a character outside "
     "printable ASCII"),
])
def test_bad_key_flags_exit_2_with_one_line(args, message, tmp_path, capsys):
  files = dict(missing=tmp_path / "missing", comments=tmp_path / "comments",
               spaced=tmp_path / "spaced")
  files["comments"].write_text("# no keys yet\n\n")
  files["spaced"].write_text("key-a\nkey b\n")
  assert _main_in_process(*(a.format(**files) for a in args)) == 2
  lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
  assert lines == ["hisparse-jax serve: error: " + message.format(**files)]


def test_the_flag_without_keys_is_the_only_line_of_the_process():
  # (checked before the engine flags, whose check logs the compilation cache's line)
  r = subprocess.run([sys.executable, "-m", "hisparse_jax", "serve", "--cache_salt_by_api_key"],
                     cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                     text=True, timeout=120)
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
  assert r.stderr.strip() == (
      "hisparse-jax serve: error: --cache_salt_by_api_key needs API keys to derive each "
      "request's salt from: give --api_key or --api_keys_file")


def test_serve_salts_by_the_keys_of_a_file_end_to_end(tmp_path):
  """The flags through a real `serve`: keys from the file and --api_key; two tenants'
  equal prompts hit only their own blocks (the engine's prefix-cache counter)."""
  path = tmp_path / "keys"
  path.write_text("# tenants\nkey-carol\n")
  server = ServerProcess(f"--api_keys_file={path}", "--api_key=key-dave",
                         "--cache_salt_by_api_key", "--served_model_name=hisparse-tiny",
                         "--block_size=16", "--device_kv_gib=0.004", "--host_pool_gib=0.05",
                         "--nowarmup")  # (start-up is test_serve_warmup.py's subject)
  try:
    prompt = _prompt(107)

    def complete(key):
      r = httpx.post(server.url + "/v1/completions", timeout=60,
                     headers={"Authorization": f"Bearer {key}"},
                     json={"model": "hisparse-tiny", "prompt": prompt, "max_tokens": 3,
                           "temperature": 0.0})
      return r.status_code, (r.json()["choices"][0]["text"] if r.status_code == 200 else None)

    def hits():
      metrics = httpx.get(server.url + "/metrics", timeout=60).text
      return sum(float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("hisparse_prefix_cache_hits_total"))

    assert complete("key-eve") == (401, None)
    before = hits()
    status, carol = complete("key-carol")
    assert status == 200 and hits() == before  # (a new tenant: nothing cached)
    assert complete("key-dave") == (200, carol) and hits() == before
    assert complete("key-carol") == (200, carol) and hits() > before
  finally:
    assert server.stop() == 0, "".join(server.log[-30:])
