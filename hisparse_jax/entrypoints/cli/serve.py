"""`hisparse-jax serve`: the OpenAI-compatible HTTP server (hisparse_jax.entrypoints.openai_server).

Usage::

  hisparse-jax serve [--host=127.0.0.1] [--port=8000] [--api_key=KEY[,KEY2...]]
      [--api_keys_file=FILE] [--cache_salt_by_api_key] [--served_model_name=NAME]
      [--drain_timeout_s=S] [--nowarmup] [engine flags of generate]

Loads the model (logging the KV capacity of each memory kind), compiles the programs a
lone request runs (--warmup, on by default: engine/warmup.py), binds the port, logs
"serving on http://HOST:PORT" and serves until SIGTERM or SIGINT. Then it drains: no new
connection is taken, new requests on open ones get 503, running requests have
--drain_timeout_s to finish (their streams are cancelled after, which aborts them), the
engine stops, and the process exits 0. `--port=0` takes a free port (the log line says
which).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket

from absl import flags, logging

from hisparse_jax.entrypoints.cli import generate as generate_cmd

FLAGS = flags.FLAGS

def served_model_name() -> str:
  if FLAGS.served_model_name:
    return FLAGS.served_model_name
  if FLAGS.model:
    return os.path.basename(os.path.normpath(FLAGS.model))
  return "hisparse-tiny"


def check_port(port: int) -> None:
  if not 0 <= port <= 65535:
    raise ValueError(f"--port must be in [0, 65535], got {port}")


def bind(host: str, port: int) -> socket.socket:
  """A listening socket (bound before the log line, so a client that reads it connects)."""
  check_port(port)
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((host, port))
  except OSError as e:
    sock.close()
    raise ValueError(f"--port={port}: cannot listen on {host}: {e.strerror or e}") from None
  sock.listen(2048)
  sock.setblocking(False)
  return sock


def main(argv: list[str]) -> int:
  del argv
  import uvicorn  # noqa: PLC0415 (serve only)

  from hisparse_jax.entrypoints.async_engine import AsyncEngine  # noqa: PLC0415
  from hisparse_jax.entrypoints.llm import LLM  # noqa: PLC0415 (imports jax)
  from hisparse_jax.entrypoints.openai_server import build_app  # noqa: PLC0415

  # bad flags fail before the load (--port before the engine flags, whose check logs the
  # compilation cache's line: a bad flag's error is the one line on stderr)
  check_port(FLAGS.port)
  from hisparse_jax.entrypoints.openai_auth import keys_from_flags  # noqa: PLC0415

  api_keys = keys_from_flags(FLAGS.api_key, FLAGS.api_keys_file)
  if FLAGS.cache_salt_by_api_key and not api_keys:
    raise ValueError("--cache_salt_by_api_key needs API keys to derive each request's salt "
                     "from: give --api_key or --api_keys_file")
  llm_kwargs = generate_cmd.engine_kwargs_from_flags(compile_in_background=True)
  if FLAGS.drain_timeout_s < 0:
    raise ValueError(f"--drain_timeout_s must be >= 0, got {FLAGS.drain_timeout_s}")
  from hisparse_jax.entrypoints.openai_server import ServerLimits  # noqa: PLC0415

  limits_flags = dict(  # ServerLimits field -> its flag's value
      max_request_bytes=FLAGS.max_request_bytes, max_prompts=FLAGS.max_prompts_per_request,
      max_prompt_tokens=FLAGS.max_request_prompt_tokens, max_logprobs=FLAGS.max_logprobs,
      request_timeout_s=FLAGS.request_timeout_s,
      max_waiting_requests=FLAGS.max_waiting_requests,
      max_concurrent_streams=FLAGS.max_concurrent_streams)
  for flag, value in (("max_request_bytes", FLAGS.max_request_bytes),
                      ("max_prompts_per_request", FLAGS.max_prompts_per_request),
                      ("max_request_prompt_tokens", FLAGS.max_request_prompt_tokens),
                      ("max_logprobs", FLAGS.max_logprobs),
                      ("request_timeout_s", FLAGS.request_timeout_s),
                      ("max_waiting_requests", FLAGS.max_waiting_requests),
                      ("max_concurrent_streams", FLAGS.max_concurrent_streams),
                      ("max_stream_buffer", FLAGS.max_stream_buffer)):
    if not (value > 0 and math.isfinite(value)):
      raise ValueError(f"--{flag} must be a positive number, got {value}")
  limits = ServerLimits(**limits_flags)
  if logging.get_verbosity() < logging.INFO:
    logging.set_verbosity(logging.INFO)  # the capacity lines and "serving on"
  sock = bind(FLAGS.host, FLAGS.port)
  engine = LLM(**llm_kwargs).engine
  from hisparse_jax.engine import compilation_cache  # noqa: PLC0415

  compilation_cache.log_pending()  # (engine_kwargs_from_flags' cache line)
  if FLAGS.warmup:  # the first requests' programs, before "serving on" (engine/warmup.py)
    from hisparse_jax.engine import warmup  # noqa: PLC0415 (imports jax)

    logging.info("%s", warmup.warm_up(engine).log_line())
  async_engine = AsyncEngine(engine, max_stream_buffer=FLAGS.max_stream_buffer)
  app = build_app(async_engine, served_model_name(), api_keys=api_keys,
                  cache_salt_by_api_key=FLAGS.cache_salt_by_api_key,
                  max_model_len=engine.config.max_model_len, limits=limits)

  @contextlib.asynccontextmanager
  async def lifespan(_app):
    async_engine.start()
    yield
    app.state.draining = True
    await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

  app.router.lifespan_context = lifespan
  class Server(uvicorn.Server):
    def handle_exit(self, sig, frame):  # SIGTERM / SIGINT: requests from now on get 503
      app.state.draining = True
      logging.info("draining: running requests get %.0f s", FLAGS.drain_timeout_s)
      super().handle_exit(sig, frame)
      # A drain is the expected end: exit 0 rather than re-raise the signal afterwards.
      self._captured_signals.clear()

  config = uvicorn.Config(app, log_level="warning", access_log=False,
                          timeout_graceful_shutdown=FLAGS.drain_timeout_s)
  server = Server(config)
  host, port = sock.getsockname()[:2]
  logging.info("serving on http://%s:%d", f"[{host}]" if ":" in host else host, port)
  server.run(sockets=[sock])
  logging.info("server stopped")
  return 0
