"""Pallas kernels for paged attention over a device-resident block array.

KV layout per layer: ``k_pages, v_pages [num_blocks, block_size, num_kv_heads,
head_dim]``; block 0 is the null block (padding in block tables). The engine's dense
rows go through ``ragged_paged_attention``; its top-k sparse decode rows through
``paged_attention`` over a block table that lists only the selected blocks.

Public API (each kernel file ends with its pure-jnp ``*_reference``, the
jit-compiled "reference" backend with the same signature; :mod:`kernels_pallas.
xla_attention` holds the "xla" backend's attention, the same contracts shaped for
XLA:CPU, tested against the references):

* ``paged_attention(q, k_pages, v_pages, block_tables, kv_lens, *, sm_scale=None,
  soft_cap=None, interpret=None, return_lse=False)`` -- decode, split-K with a log-sum-exp
  combine; ``return_lse`` also gives each head's log-sum-exp, and ``merge_attention``
  merges two such results over disjoint key sets exactly (HiSparse's overlapped loads).
* ``paged_attention_per_head(q, k_pages, v_pages, block_tables, kv_lens)`` -- decode
  with a block table per head (HiSparse's per-head selections); XLA gather, no Pallas
  kernel yet.
* ``ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens,
  *, sm_scale=None, soft_cap=None, sliding_window=None, interpret=None)`` --
  prefill, chunked prefill and decode rows, causal with offset kv_len - q_len.
* ``write_kv(k_pages, v_pages, k_new, v_new, slot_ids)`` -- in place (donated);
  negative slots skipped.
* ``block_key_bounds(bounds, k_pages, slot_ids)`` -- per-block key min/max,
  ``bounds [num_blocks, 2, num_kv_heads, head_dim]`` (0 = min, 1 = max), donated.
* ``block_scores(q, bounds, rows, *, per_query_head=False)`` -- HiSparse's block scores
  (each head's upper bound of q . k over a listed block's keys) from those bounds read in
  place through each row's list of bounds rows; the GPU backends' select.
* ``index_scores(index_q, index_w, index_pages, tables, host_index=None, host_tables=None)``
  -- DSA's lightning-indexer score of every key a token's table lists, the paged indexer
  keys (and a tiered row's host copies) read in place, bf16 / float32 or 8-bit
  (``QuantizedPages``: int8 / fp8_e4m3 with a float32 scale per token); the GPU backends'
  DSA select.
* ``sparse_mla_decode(q, kv_pages, indices, *, sm_scale, kv_lora_rank, interpret=None)``
  -- DSA models: each query row over its own listed tokens of a paged MLA latent cache
  (``kv_pages [num_blocks, block_size, 1, kv_lora_rank + rope]``, flat token ids,
  negative = padding), absorbed form: the value is an entry's latent part.

Every kernel that reads pages also takes 8-bit pages (``kernels_pallas.quant.
QuantizedPages``: int8 or fp8_e4m3 values + a float32 scale per token and KV head),
dequantized per loaded block.

Backend choice lives in :mod:`kernels_pallas.backend` alone. The engine calls
``ops(backend=None)``: ``"auto"``/``None`` gives the xla backend on CPU (and TPU) and
the Pallas kernels on GPU; ``"pallas"``/``"xla"``/``"reference"`` force one. A kernel's
own ``interpret=None`` means interpret mode on CPU (tests), compiled (Triton) on
GPU.

Scripts: ``python -m kernels_pallas.bench --out results/kernel_bench_<platform>.json``
(each kernel vs its reference, table + JSON) and ``python -m kernels_pallas.selfcheck``
(compiled kernels vs references on the current device; the GPU verification).
"""

from kernels_pallas.backend import KernelOps, ops, resolve_backend, resolve_interpret
from kernels_pallas.block_key_bounds import block_key_bounds, block_key_bounds_reference
from kernels_pallas.block_scores import block_scores, block_scores_reference
from kernels_pallas.index_scores import index_scores, index_scores_reference
from kernels_pallas.paged_attention import (
    merge_attention,
    paged_attention,
    paged_attention_per_head,
    paged_attention_reference,
)
from kernels_pallas.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from kernels_pallas.sparse_mla import sparse_mla_decode, sparse_mla_decode_reference
from kernels_pallas.write_kv import write_kv, write_kv_reference
from kernels_pallas.xla_attention import paged_attention_xla, ragged_paged_attention_xla

__all__ = [
    "KernelOps",
    "block_key_bounds",
    "block_key_bounds_reference",
    "block_scores",
    "block_scores_reference",
    "index_scores",
    "index_scores_reference",
    "merge_attention",
    "ops",
    "paged_attention",
    "paged_attention_per_head",
    "paged_attention_reference",
    "paged_attention_xla",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_xla",
    "resolve_backend",
    "resolve_interpret",
    "sparse_mla_decode",
    "sparse_mla_decode_reference",
    "write_kv",
    "write_kv_reference",
]
