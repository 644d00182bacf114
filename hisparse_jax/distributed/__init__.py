"""Distributed execution: tensor parallelism over one jax Mesh, multi-host start-up.

  parallel.py   make_mesh (tensor_parallel_size), the KV shardings (split by KV head, both
                memory kinds), live_bytes (per device: the capacity lines),
                initialize_distributed (jax.distributed, the coordinator checked first)

May import: models (its sharding rules: models.sharding); nothing of hisparse_jax.
"""
