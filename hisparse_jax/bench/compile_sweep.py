"""Deviceless compile sweep: the engine's step programs for the H200 through the project's
own entry point (`hisparse-jax compile --target=h200`, one subprocess a config) over model
shapes the unit tests do not build: GQA ratios 1-8, head_dim 64 / 80 / 96 / 128 / 256,
sliding window, blocks of 8-64, 8-bit KV and key bounds, both GPU kernel backends, HiSparse
on and off; and DSA geometries (latent 192-512 + rope 32/64, indexer 64-128 wide, blocks
16 / 64, 8-bit indexer keys). A config fails when `compile` exits 1 (a program did not
compile); exit 2 is a refusal at start, with its one line (expected for what is not
built, e.g. HiSparse over sliding-window models).

    python -m hisparse_jax.bench.compile_sweep [llama|dsa] [NAME_FILTER]   # ~45 / ~20 min

Prints one line a config (rc, seconds, the error line) and exits 1 when any config failed
to compile. Random checkpoints (models.testing) and config files under $TMPDIR.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

# name -> (query heads, KV heads, head_dim, sliding window)
LLAMA_GEOMETRIES = {
    "mha64": (4, 4, 64, None), "gqa4_128": (8, 2, 128, None), "gqa8_128": (16, 2, 128, None),
    "mqa256": (4, 1, 256, None), "gqa2_96": (4, 2, 96, None), "gqa4_80": (8, 2, 80, None),
    "swa128": (8, 2, 128, 64),
}
# name -> (heads, kv_lora_rank, rope, indexer heads, indexer dim, index_topk)
DSA_GEOMETRIES = {
    "v32": (16, 512, 64, 64, 128, 2048), "glm5ish": (16, 512, 64, 32, 128, 2048),
    "small": (8, 256, 64, 16, 64, 512), "odd": (4, 192, 32, 8, 96, 256),
}


def llama_checkpoint(root: str, name: str) -> str:
  from models import data, testing  # noqa: PLC0415
  from models.config import ModelConfig  # noqa: PLC0415

  q, kv, dim, window = LLAMA_GEOMETRIES[name]
  path = os.path.join(root, name)
  if not os.path.exists(os.path.join(path, "config.json")):
    config = ModelConfig(model_type="mistral" if window else "llama",
                         vocab_size=len(data.VOCAB), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=q, num_key_value_heads=kv,
                         head_dim=dim, max_position_embeddings=4096, sliding_window=window,
                         bos_token_id=data.BOS_ID, eos_token_id=data.EOS_ID)
    testing.save_random_checkpoint(path, config=config)
  return path


def dsa_config(root: str, name: str) -> str:
  import transformers  # noqa: PLC0415

  heads, rank, rope, index_heads, index_dim, topk = DSA_GEOMETRIES[name]
  path = os.path.join(root, name)
  if not os.path.exists(os.path.join(path, "config.json")):
    transformers.DeepseekV32Config(
        vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads,
        n_shared_experts=1, n_routed_experts=4, n_group=1, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=2, kv_lora_rank=rank,
        q_lora_rank=2 * rank, qk_rope_head_dim=rope, qk_nope_head_dim=64, v_head_dim=64,
        index_topk=topk, index_head_dim=index_dim, index_n_heads=index_heads,
        max_position_embeddings=16384, bos_token_id=0, eos_token_id=1).save_pretrained(path)
  return path


def llama_runs(root: str, name_filter: str = ""):
  """(label, compile flags) of each llama config."""
  for geom in LLAMA_GEOMETRIES:
    if name_filter not in geom:
      continue
    path = llama_checkpoint(root, geom)
    for backend in ("pallas", "pallas_mgpu"):
      # Dense at blocks 8 / 32 (int8) / 64; HiSparse at block 16 over each KV dtype.
      cases = [("auto", 8, False), ("int8", 32, False), ("auto", 64, False)]
      cases += [(kv, 16, True) for kv in ("auto", "int8", "fp8_e4m3")]
      for kv, bs, hisparse in cases:
        flags = [f"--model={path}", f"--kv_cache_dtype={kv}", f"--block_size={bs}",
                 f"--kernel_backend={backend}", "--max_model_len=2048", "--max_num_seqs=8",
                 "--device_kv_gib=0.25", "--host_pool_gib=0.25"]
        if hisparse:
          flags += ["--hisparse", "--top_k_tokens=256", "--hot_buffer_tokens=512",
                    "--programs=decode,mixed,tiered_decode"]
          flags += ["--bounds_dtype=int8"] if kv == "int8" else []
        else:
          flags += ["--programs=decode,mixed"]
        yield f"{geom:9s} {backend:11s} {kv:8s} bs{bs:<3d} hisparse={int(hisparse)}", flags


def dsa_runs(root: str, name_filter: str = ""):
  """(label, compile flags) of each DSA config (the Mosaic GPU sparse MLA decode only
  where its limits allow: kv_lora_rank a multiple of 64, rope 64)."""
  for geom in DSA_GEOMETRIES:
    if name_filter not in geom:
      continue
    path = dsa_config(root, geom)
    _, rank, rope, _, _, _ = DSA_GEOMETRIES[geom]
    for backend in ("pallas", "pallas_mgpu"):
      if backend == "pallas_mgpu" and (rope != 64 or rank % 64):
        continue
      for index in ("auto", "fp8_e4m3", "int8"):
        for bs in (16, 64):
          flags = [f"--model={path}", f"--index_cache_dtype={index}", f"--block_size={bs}",
                   f"--kernel_backend={backend}", "--max_model_len=16384", "--max_num_seqs=8",
                   "--device_kv_gib=1", "--host_pool_gib=1", "--hisparse",
                   "--programs=decode,mixed,tiered_decode"]
          yield f"{geom:9s} {backend:11s} {index:8s} bs{bs:<3d}", flags


def run(kind: str = "llama", name_filter: str = "", root: str | None = None,
        limit: int | None = None) -> list[dict]:
  """Compiles every config of `kind` (the first `limit`); one dict a config: label, rc,
  seconds, error."""
  root = root or os.path.join(tempfile.gettempdir(), "hisparse_compile_sweep")
  os.makedirs(root, exist_ok=True)
  runs = llama_runs(root, name_filter) if kind == "llama" else dsa_runs(root, name_filter)
  results = []
  for i, (label, flags) in enumerate(runs):
    if limit is not None and i >= limit:
      break
    start = time.time()
    r = subprocess.run([sys.executable, "-m", "hisparse_jax", "compile", "--target=h200",
                        "--dtype=bfloat16", f"--out={os.path.join(root, 'report.json')}",
                        *flags], capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("hisparse-jax compile:")]
    result = dict(label=label, rc=r.returncode, seconds=round(time.time() - start, 1),
                  error=(errors[-1] if errors else
                         (r.stderr.strip().splitlines() or [""])[-1]) if r.returncode else None)
    print(f"{label} rc={result['rc']} {result['seconds']:5.1f}s"
          + (f"  {result['error'][:300]}" if result["error"] else ""), flush=True)
    results.append(result)
  return results


def main(argv: list[str]) -> int:
  kind = argv[1] if len(argv) > 1 else "llama"
  if kind not in ("llama", "dsa"):
    print(f"compile_sweep: the first argument must be llama or dsa, got {kind!r}",
          file=sys.stderr)
    return 2
  results = run(kind, argv[2] if len(argv) > 2 else "")
  failed = [r for r in results if r["rc"] == 1]
  print(f"{len(results)} configs: {len(failed)} failed to compile, "
        f"{sum(r['rc'] == 2 for r in results)} refused at start")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
