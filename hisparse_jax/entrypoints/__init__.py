"""How users reach the engine.

  llm.py             LLM: batch generation (vLLM's offline API: generate, chat)
  async_engine.py    AsyncEngine: one thread steps the Engine; asyncio streams per request
  openai_server.py   the OpenAI-compatible FastAPI app: build_app and its routes
                     (/v1/completions, /v1/chat/..., /metrics, /health, /tokenize, ...)
  openai_*.py        the app's parts: protocol (bodies), errors, auth (API keys, the
                     cache salt by key), limits (gate, request limits), streaming
                     (answers, SSE), schema (/openapi.json)
  cli/               the `hisparse-jax` command: main.py (absl dispatcher, shared flags),
                     one module per command (capacity, generate, demo, serve, bench)

May import: engine, sparse, kv_cache, distributed, observability, models, configs,
kernels_pallas; and bench, from cli/bench.py only (the `bench` command runs the suites).
Nothing below imports it.
"""
