"""HiSparseConfig: the knobs of top-k sparse decoding over the hierarchical KV cache.

Owns the validated settings and their conversion from tokens (what users set) to
blocks (what the indexer and resolver work in). Budget rule, decided here: **sink
and local blocks are part of the top-k budget**, not added to it, so a step attends
at most `top_k_blocks` blocks per sequence (and per KV head), whatever the sink and
local settings; the indexer's scores pick the remaining
`top_k_blocks - sink_blocks - local_blocks`. This keeps the attention cost and the
hot-buffer demand of a step bounded by the one number users tune (as DSA's
top-k of 2048 tokens is the whole budget in SGLang's HiSparse).

  logical blocks of one sequence:  [S S . x . . x . . x . L L]
                                    ^sink        ^scored  ^local (newest, partly filled, last)
  selected = sink + top scored + local  (= min(top_k_blocks, valid blocks))

The newest block (which holds the token being decoded) is always selected: the local
window is at least one block even with `local_tokens=0`.
"""

from __future__ import annotations

import dataclasses
import math

INDEXERS = ("block_bounds", "lightning")
MAX_DEFAULT_SINK_TOKENS = 64  # default sink_tokens: min(this, top_k_tokens // 8)
MAX_DEFAULT_LOCAL_TOKENS = 256  # default local_tokens: min(this, top_k_tokens // 4)
# A derived top-k holds at least this many blocks, so that the default sink and local
# windows (an eighth and a quarter of it, each rounded up to whole blocks) fit inside it.
MIN_DEFAULT_TOP_K_BLOCKS = 4
SELECTIONS = ("union", "shared", "per_kv_head", "per_query_head")
# Dtype of the indexer's key bounds (kept on the device for every device AND host block):
# bfloat16 halves their bytes, int8 (a float32 scale per block, side and KV head) halves
# them again (both rounded outward, so a block's score stays an upper bound).
BOUNDS_DTYPES = ("bfloat16", "float32", "int8")

# How a streamed prompt's prefill chunk (a prompt longer than the device pool, some of its
# earlier blocks on the host only) attends over its earlier blocks: "exact" over all of
# them, loaded from the host in groups through its hot buffer (the dense prefill's keys,
# more host traffic); "sparse" over the top-k of them, selected like a decode row.
STREAMED_PREFILLS = ("exact", "sparse")
# How a waiting request gets device room when the device is short (Scheduler):
# "offload": running sparse decoders are offloaded to admit it, and a prompt that will
# decode sparse is admitted streamed (chunk by chunk) when its whole prompt does not fit;
# "wait": it waits for free device blocks (the policy hisparse_throughput compares).
ADMISSIONS = ("offload", "wait")

# Default `resident_sparse_min_tokens`: the attention tokens a step's resident sparse rows
# must skip together before they take the sparse path. 0 (always sparse): on the real
# model, 1-2 requests of 2,000 tokens in their own worker processes, alternated, decode
# as fast or faster sparse (c = 2: 1.09x device-only sparse, 0.92x dense at 4,096; c = 1:
# 0.94x and 0.93x, within the VM's noise); the 4,096 of session 18 came from engines built
# second in one process, which step slower (WORKSPACE.md, "resident rows").
DEFAULT_RESIDENT_SPARSE_MIN_TOKENS = 0


@dataclasses.dataclass(frozen=True)
class HiSparseBlocks:
  """The token settings of a HiSparseConfig in blocks of `block_size` tokens.

  Invariant: `1 <= local_blocks`, `sink_blocks + local_blocks <= top_k_blocks <=
  hot_buffer_blocks` (so a step's misses always find a hot-buffer slot not used by
  that step), `sparse_threshold_blocks` = blocks of the longest dense sequence.
  """

  block_size: int
  top_k_blocks: int
  hot_buffer_blocks: int
  sink_blocks: int
  local_blocks: int
  sparse_threshold_blocks: int


@dataclasses.dataclass(frozen=True)
class HiSparseConfig:
  """Top-k sparse decoding settings, in tokens.

  Invariants (checked in `__post_init__`, ValueError naming the field):
  `top_k_tokens > 0`; `hot_buffer_tokens >= top_k_tokens` (default 2 x top_k, as
  SGLang's `device_buffer_size`); `sink_tokens, local_tokens >= 0` (defaults
  min(64, top_k / 8) and min(256, top_k / 4): 64 and 256 from a top-k of 1,024) and
  `sink_tokens + local_tokens <= top_k_tokens` (they are part of the budget);
  `sparse_threshold_tokens > 0` (default: `hot_buffer_tokens`; sequences up to this
  length take the dense path, exact and without host traffic); `indexer` in INDEXERS:
  "block_bounds" (llama-family models: per-block key bounds) or "lightning" (DSA models:
  their learned indexer, `for_index_topk`; the engine refuses the other pairings);
  `selection` in SELECTIONS (default "union": one set of blocks for all heads, the
  union of each query head's best-ranked ones; sparse/indexer.py);
  `resident_sparse_min_tokens >= 0` (default DEFAULT_RESIDENT_SPARSE_MIN_TOKENS, 0: a
  step whose sparse rows all have every block on the device takes the sparse path only
  if together they skip at least this many tokens of attention, the sum of kv_len -
  top_k_tokens; else they attend densely, exactly as without HiSparse, for a platform
  where the sparse path's fixed cost outweighs what it skips; a step with an offloaded
  row always takes it; 0: resident long rows always decode sparse);
  `thrash_window_steps >= 0`; `bounds_dtype` in BOUNDS_DTYPES ("bfloat16", "float32",
  "int8"): the dtype of the indexer's key bounds (WORKSPACE.md has the selection accuracy
  of each); `streamed_prefill` in STREAMED_PREFILLS (default
  "exact": a prompt longer than the device pool prefills as dense attention would);
  `admission` in ADMISSIONS (default "offload": running sparse decoders make room for a
  waiting request, which may itself stream in; "wait": it waits for free blocks).
  """

  top_k_tokens: int = 2048
  hot_buffer_tokens: int | None = None
  sink_tokens: int | None = None
  local_tokens: int | None = None
  sparse_threshold_tokens: int | None = None
  resident_sparse_min_tokens: int = DEFAULT_RESIDENT_SPARSE_MIN_TOKENS
  indexer: str | None = None  # None: "block_bounds" (a DSA model: its "lightning")
  selection: str = "union"
  thrash_window_steps: int = 8
  bounds_dtype: str = "bfloat16"
  streamed_prefill: str = "exact"
  admission: str = "offload"
  # The fields left to their defaults at construction (derived here, not given):
  # `for_index_topk` derives those from the model's index_topk instead. Not carried by
  # dataclasses.replace (its values count as given).
  # (a sorted tuple: dataclasses.asdict of a config stays JSON, as the benches write it)
  defaulted: tuple = dataclasses.field(init=False, repr=False, compare=False, default=())

  def __post_init__(self):
    object.__setattr__(self, "defaulted", tuple(sorted(
        name for name in ("hot_buffer_tokens", "sink_tokens", "local_tokens",
                          "sparse_threshold_tokens", "indexer")
        if getattr(self, name) is None)))
    if self.indexer is None:
      object.__setattr__(self, "indexer", "block_bounds")
    if self.hot_buffer_tokens is None:
      _set_default(self, "hot_buffer_tokens", 2 * _int(self, "top_k_tokens"))
    if self.sparse_threshold_tokens is None:
      _set_default(self, "sparse_threshold_tokens", _int(self, "hot_buffer_tokens"))
    lightning = self.indexer == "lightning"  # (the learned indexer picks every token)
    if self.sink_tokens is None:
      _set_default(self, "sink_tokens", 0 if lightning else min(
          MAX_DEFAULT_SINK_TOKENS, _int(self, "top_k_tokens") // 8))
    if self.local_tokens is None:
      _set_default(self, "local_tokens", 0 if lightning else min(
          MAX_DEFAULT_LOCAL_TOKENS, _int(self, "top_k_tokens") // 4))
    for name in ("top_k_tokens", "hot_buffer_tokens", "sparse_threshold_tokens"):
      if _int(self, name) <= 0:
        raise ValueError(f"HiSparseConfig.{name} must be positive, got {getattr(self, name)}")
    for name in ("sink_tokens", "local_tokens", "thrash_window_steps",
                 "resident_sparse_min_tokens"):
      if _int(self, name) < 0:
        raise ValueError(f"HiSparseConfig.{name} must be >= 0, got {getattr(self, name)}")
    # (lightning: the model's index_topk is the top-k; for_index_topk checks against it)
    if self.hot_buffer_tokens < self.top_k_tokens and self.indexer != "lightning":
      raise ValueError(
          f"HiSparseConfig.hot_buffer_tokens ({self.hot_buffer_tokens}) must be >= "
          f"top_k_tokens ({self.top_k_tokens}): a step's selected blocks must fit the "
          "hot buffer at once")
    if (self.sink_tokens + self.local_tokens > self.top_k_tokens
        and self.indexer != "lightning"):
      raise ValueError(
          f"HiSparseConfig.sink_tokens + local_tokens ({self.sink_tokens} + "
          f"{self.local_tokens}) must be <= top_k_tokens ({self.top_k_tokens}): sink and "
          "local blocks are part of the top-k budget")
    if self.indexer not in INDEXERS:
      raise ValueError(f"HiSparseConfig.indexer must be one of {INDEXERS}, got "
                       f"{self.indexer!r}")
    if self.bounds_dtype not in BOUNDS_DTYPES:
      raise ValueError(f"HiSparseConfig.bounds_dtype must be one of {BOUNDS_DTYPES}, got "
                       f"{self.bounds_dtype!r}")
    if self.streamed_prefill not in STREAMED_PREFILLS:
      raise ValueError(f"HiSparseConfig.streamed_prefill must be one of {STREAMED_PREFILLS}, "
                       f"got {self.streamed_prefill!r}")
    if self.admission not in ADMISSIONS:
      raise ValueError(f"HiSparseConfig.admission must be one of {ADMISSIONS}, got "
                       f"{self.admission!r}")
    if self.selection not in SELECTIONS:
      raise ValueError(f"HiSparseConfig.selection must be one of {SELECTIONS}, got "
                       f"{self.selection!r}")

  @classmethod
  def for_max_model_len(cls, max_model_len: int, block_size: int, **settings
                        ) -> HiSparseConfig:
    """The settings for requests of up to `max_model_len` tokens in blocks of
    `block_size`; `settings` (fields left None are derived) win. Derived: top-k a
    quarter of `max_model_len` (what kept the default model's retrieval at its dense
    accuracy with 4-token blocks, WORKSPACE.md), in whole blocks, at least
    `MIN_DEFAULT_TOP_K_BLOCKS` blocks and at most 2,048 tokens (the library default,
    DSA's); the hot buffer, threshold, sink and local windows follow the top-k as in the
    constructor. At max_model_len 2,048: top-k 512, hot buffer and threshold 1,024, so
    requests past 1,024 tokens decode sparse."""
    settings = {k: v for k, v in settings.items() if v is not None}
    if "top_k_tokens" not in settings:
      quarter = math.ceil(max_model_len / 4 / block_size) * block_size
      settings["top_k_tokens"] = max(MIN_DEFAULT_TOP_K_BLOCKS * block_size,
                                     min(cls.top_k_tokens, quarter))
    return cls(**settings)

  def for_index_topk(self, index_topk: int, max_model_len: int) -> HiSparseConfig:
    """The settings a DSA model runs with (`indexer="lightning"`): its learned indexer
    attends the model's `index_topk` tokens per query, so that is the top-k (whatever
    top_k_tokens said), with no sink or local window (the indexer picks every token); the
    hot buffer (token slots per offloaded request) must hold index_topk tokens. Settings
    left to their defaults follow the model, not the block top-k's default: the indexer
    is "lightning", the hot buffer 2 x index_topk, but at most half of max_model_len
    (never below index_topk) so that long requests offload, and the sparse threshold the
    hot buffer. ValueError naming the field: a hot buffer below index_topk, or an
    index_topk not below max_model_len (every query would attend every earlier token:
    nothing to select)."""
    given = self
    if "indexer" in self.defaulted:
      given = dataclasses.replace(given, indexer="lightning")
    if "hot_buffer_tokens" in self.defaulted:
      hot = max(index_topk, min(2 * index_topk, max_model_len // 2))
      given = dataclasses.replace(given, hot_buffer_tokens=hot)
      if "sparse_threshold_tokens" in self.defaulted:
        given = dataclasses.replace(given, sparse_threshold_tokens=hot)
    self = given  # noqa: PLW0642 (the settings with the model's defaults filled in)
    if self.indexer != "lightning":
      raise ValueError(f"HiSparseConfig.indexer={self.indexer!r}: a DSA model selects with "
                       "its learned indexer; use indexer='lightning' (--hisparse_indexer="
                       "lightning)")
    if index_topk >= max_model_len:
      raise ValueError(f"index_topk={index_topk} (the model's config.json) is not below "
                       f"max_model_len={max_model_len}: every query attends every earlier "
                       "token, so HiSparse has nothing to select; raise max_model_len or run "
                       "without hisparse")
    if self.hot_buffer_tokens < index_topk:
      raise ValueError(f"HiSparseConfig.hot_buffer_tokens ({self.hot_buffer_tokens}) must "
                       f"be >= the model's index_topk ({index_topk}): a step's selected "
                       "tokens must fit the hot buffer at once")
    return dataclasses.replace(self, top_k_tokens=index_topk, sink_tokens=0, local_tokens=0)

  def blocks(self, block_size: int) -> HiSparseBlocks:
    """The settings in blocks: each token figure rounded up to whole blocks, the local
    window at least one block. ValueError if the rounding breaks the budget rule."""
    if not isinstance(block_size, int) or block_size <= 0:
      raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    out = HiSparseBlocks(
        block_size=block_size,
        top_k_blocks=math.ceil(self.top_k_tokens / block_size),
        hot_buffer_blocks=math.ceil(self.hot_buffer_tokens / block_size),
        sink_blocks=math.ceil(self.sink_tokens / block_size),
        local_blocks=max(1, math.ceil(self.local_tokens / block_size)),
        sparse_threshold_blocks=math.ceil(self.sparse_threshold_tokens / block_size))
    if out.sink_blocks + out.local_blocks > out.top_k_blocks and self.indexer != "lightning":
      raise ValueError(
          f"HiSparseConfig: with block_size {block_size}, sink_tokens {self.sink_tokens} "
          f"and local_tokens {self.local_tokens} round to {out.sink_blocks} + "
          f"{out.local_blocks} blocks, more than top_k_tokens {self.top_k_tokens} = "
          f"{out.top_k_blocks} blocks; raise top_k_tokens or lower sink/local")
    return out

  def is_sparse(self, seq_len: int) -> bool:
    """Whether a sequence of `seq_len` tokens takes the sparse path."""
    return seq_len > self.sparse_threshold_tokens


def _int(config: HiSparseConfig, name: str) -> int:
  value = getattr(config, name)
  if isinstance(value, bool) or not isinstance(value, int):
    raise ValueError(f"HiSparseConfig.{name} must be an integer, got {value!r}")
  return value


def _set_default(config: HiSparseConfig, name: str, value: int) -> None:
  object.__setattr__(config, name, value)
