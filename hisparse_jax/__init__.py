"""hisparse_jax: LLM decoding in JAX with a KV cache tiered over device and pinned host memory."""

__version__ = "0.1.0"
