"""The README "Results" tables, made from one `hisparse-jax bench` JSON file.

``python -m hisparse_jax.bench.report results/bench_cpu.json`` prints the Markdown the
README carries (``results/passkey_cpu.json``: its passkey section);
tests/hisparse_jax/bench/test_bench.py (and test_bench_named_suites.py, for the suites run
by name) checks that the README holds exactly this text for the committed JSON, so the
README cannot drift from the recorded run.
"""

from __future__ import annotations

import json
import sys


def _fmt(x: float) -> str:
  return f"{x:,.2f}" if abs(x) < 100 else f"{x:,.0f}"


def _vllm_setup(v: dict) -> str:
  """What engine_vs_vllm's JSON says of the models and of vLLM's CPU threads ('' for runs
  that recorded neither)."""
  parts = []
  if v.get("converted"):
    parts.append(f"real_* workloads: {', '.join(v['converted'])} converted to a float32 HF "
                 "directory that both engines load, the same KV bytes for both")
  vllm = [e for e in v.get("engines_by_model", {}).get("vllm", {}).values()]
  if vllm and "VLLM_CPU_NUM_OF_RESERVED_CPU" in vllm[0]:
    reserved = vllm[0]["VLLM_CPU_NUM_OF_RESERVED_CPU"]
    parts.append("vLLM's CPU threads at its default (one core kept for its front end, its "
                 "compute threads on the others)" if reserved == "default" else
                 f"vLLM with VLLM_CPU_NUM_OF_RESERVED_CPU={reserved} (its compute threads "
                 "on every core)")
  if v.get("workloads") and any("median_cpu_s" in r for w in v["workloads"].values()
                                for r in w["rows"].values()):
    parts.append("CPU s: median CPU seconds of the engine's processes per round")
  return "; " + "; ".join(parts) if parts else ""


def summary_rows(result: dict) -> list[tuple[str, str, str, str]]:
  """(suite, figure, value, goal) for each headline figure of the suites that ran."""
  suites = result["suites"]
  rows = []
  if "transfer" in suites:
    t = suites["transfer"]
    for key in ("h2d_vs_memcpy", "d2h_vs_memcpy"):
      rows.append(("transfer", f"`{key}` (geomean; min {_fmt(t[key + '_min'])})",
                   _fmt(t[key]), ">= 0.8"))
  if "decode_sparse_vs_dense" in suites:
    d = suites["decode_sparse_vs_dense"]
    for r in d["rows"]:
      goal = f">= {_fmt(r['bytes_bound'] / 2)}" if r is d["rows"][-1] else "-"
      rows.append(("decode_sparse_vs_dense",
                   f"`dense_over_sparse` at {r['context']:,} (`bytes_bound` "
                   f"{_fmt(r['bytes_bound'])})", _fmt(r["dense_over_sparse"]), goal))
  if "hisparse_throughput" in suites and "lengths" in suites["hisparse_throughput"]:
    t = suites["hisparse_throughput"]  # a long size (throughput_long): its must-show goal
    shown = t.get("must_show") or {}
    for row in t["lengths"]:
      r, length = row["ratios"], row["length"]
      rows.append(("hisparse_throughput", f"long {length:,}: offload / device-only decode "
                   "tok/s", _fmt(r["offload_vs_device_only_decode"]),
                   f">= {shown['goal_decode_vs_device_only']}"
                   if length == shown.get("length") else "-"))
      rows.append(("hisparse_throughput", f"long {length:,}: offload / wait decode tok/s",
                   _fmt(r["offload_vs_wait_decode"]), "-"))
  elif "hisparse_throughput" in suites:
    r = suites["hisparse_throughput"]["ratios"]
    if "decode_vs_device_only" in r:  # (not in a sweep-only run, --bench_size=sweep)
      rows.append(("hisparse_throughput", "HiSparse decode tok/s / device-only",
                   _fmt(r["decode_vs_device_only"]), ">= 1.5"))
    if "decode_vs_vllm" in r:
      rows.append(("hisparse_throughput", "HiSparse decode tok/s / vLLM",
                   _fmt(r["decode_vs_vllm"]), ">= 1.5"))
    if "e2e_vs_device_only" in r:
      rows.append(("hisparse_throughput", "HiSparse e2e tok/s / device-only",
                   _fmt(r["e2e_vs_device_only"]), "-"))
    for c, x in r["sweep_decode_vs_device_only"].items():
      rows.append(("hisparse_throughput", f"sweep: HiSparse / device-only decode at {c} at once",
                   _fmt(x), ">= 0.95" if int(c) <= 2 else "> 1" if int(c) >= 8 else "-"))
  if "hisparse_hot_buffer" in suites:
    h = suites["hisparse_hot_buffer"]
    rows.append(("hisparse_hot_buffer", "step at 100% hot-buffer hits / step at 0% "
                 f"(memory-bound on one memory: {_fmt(h['bytes_model_100_over_0'])})",
                 _fmt(h["step_100_over_0"]), "<= 0.6"))
    worst = max(r["h2d_over_missed"] for r in h["rates"] if r["missed_blocks_per_step"])
    rows.append(("hisparse_hot_buffer", "host -> device bytes / missed blocks' bytes "
                 "(worst rate with a miss; at 100% hits: "
                 f"{h['rates'][-1]['h2d_bytes_per_step']:,} bytes)", _fmt(worst),
                 "1 - 2 (bucket)"))
  if "capacity_concurrency" in suites:
    c = suites["capacity_concurrency"]
    for key in ("concurrency_ratio", "throughput_ratio"):
      rows.append(("capacity_concurrency", f"`{key}`", _fmt(c[key]), "-"))
    if "decode_heavy" in c:  # (older JSONs lack it)
      h = c["decode_heavy"]
      shape = f"{h['config']['prompt_len']:,} + {h['config']['max_tokens']}"
      rows.append(("capacity_concurrency", f"`decode_heavy.throughput_ratio` ({shape})",
                   _fmt(h["throughput_ratio"]), ">= 1.3"))
  if "engine_vs_hf" in suites:
    e = suites["engine_vs_hf"]
    rows.append(("engine_vs_hf", "`tokens_per_s_ratio_vs_hf`",
                 _fmt(e["tokens_per_s_ratio_vs_hf"]), ">= 1.0"))
    rows.append(("engine_vs_hf", "`tokens_per_s_ratio_vs_dense_jax`",
                 _fmt(e["tokens_per_s_ratio_vs_dense_jax"]), ">= 0.8"))
  if "engine_vs_vllm" in suites:
    v = suites["engine_vs_vllm"]
    for name, w in v["workloads"].items():
      shape = f"{w['workload']['num_prompts']} x {w['workload']['prompt_len']:,} + " \
              f"{w['workload']['new_tokens']}"
      rows.append(("engine_vs_vllm", f"`speed_vs_vllm` {name} ({shape})",
                   _fmt(w["speed_vs_vllm"]),
                   f">= {w.get('goal_speed_vs_vllm', v['goal_speed_vs_vllm'])}"))
  if "scheduler_overhead" in suites:
    s = suites["scheduler_overhead"]
    rows.append(("scheduler_overhead", f"`host_us_per_seq_step` at {s['running_seqs']} seqs",
                 _fmt(s["host_us_per_seq_step"]), f"<= {s['goal_host_us_per_seq_step']}"))
    c = s["by_context"]
    short, long = min(map(int, c["rows"])), max(map(int, c["rows"]))
    rows.append(("scheduler_overhead", f"host time per step, {long:,} vs {short:,} tokens "
                 f"of context ({c['num_seqs']} seqs, caches flushed alike; as run "
                 f"{_fmt(c['host_ratio_long_vs_short_warm'])})",
                 _fmt(c["host_ratio_long_vs_short"]), f"<= {c['goal_ratio']}"))
  if "serve_load" in suites:
    sl = suites["serve_load"]
    rows.append(("serve_load", f"output tokens/s, {sl['num_clients']} streaming clients over "
                 f"HTTP / the same requests through `LLM.generate` (compile stalls in the timed "
                 f"rounds: {sl.get('server_compile_stalls', sl['server_step_shapes_new']):.0f}"
                 + (f"; steps on a covering shape while {sl['server_background_compiles']:.0f} "
                    f"compiled in the background: {sl['server_steps_on_covering_shape']:.0f}"
                    if "server_background_compiles" in sl else "") + ")",
                 _fmt(sl["served_over_offline"]), "-"))
  if "kernel" in suites:
    for name, k in suites["kernel"]["summary"].items():
      rows.append(("kernel", f"{name}: {k['pallas_impl']} / jnp reference time",
                   _fmt(k["pallas_over_reference"]), "-"))
  return rows


def markdown(result: dict) -> str:
  """Machine line, headline table, and the decode table per context."""
  m = result["machine"]
  load = ", ".join(f"{x:.2f}" for x in m["load_avg_1_5_15"])
  lines = [f"Machine: {m['cpu_model']}, {m['cpu_cores']} cores, {m['ram_gib']} GiB RAM, "
           f"{m['platform']} ({m['device_kind']}), jax {m['jax_version']}, load average "
           f"{load} at the start; {result['seconds']['total']:.0f} s in all, "
           f"{m['date_utc']}."]
  headline = summary_rows(result)
  if headline:  # (a passkey-only run has none)
    lines += ["", "| suite | figure | value | goal |", "|---|---|---|---|"]
    lines += [f"| {s} | {f} | {v} | {g} |" for s, f, v, g in headline]
  if "engine_vs_vllm" in result["suites"]:
    v = result["suites"]["engine_vs_vllm"]
    engines = v["engines"]
    reps = sorted({w.get("reps", v["reps"]) for w in v["workloads"].values()})
    cpu = all("median_cpu_s" in r for w in v["workloads"].values() for r in w["rows"].values())
    lines += ["", f"Against vLLM {engines['vllm'].get('vllm_version', '')} (CPU build, its "
              f"own process and venv), greedy, prefix caching off, max_model_len "
              f"{v['max_model_len']:,}, median of {'/'.join(map(str, reps))} alternated "
              "rounds, greedy tokens identical in every round" + _vllm_setup(v) + ":", "",
              "| workload | engine | s | output tokens/s | TTFT p50 ms | ITL p50 ms |"
              + (" CPU s |" if cpu else ""), "|---|---|---|---|---|---|" + ("---|" if cpu else "")]
    for name, w in v["workloads"].items():
      for engine, r in w["rows"].items():
        lines.append(f"| {name} | {engine} | {_fmt(r['median_s'])} | "
                     f"{_fmt(r['tokens_per_s'])} | {_fmt(r['ttft_p50_ms'])} | "
                     f"{_fmt(r['itl_p50_ms'])} |" + (f" {_fmt(r['median_cpu_s'])} |" if cpu
                                                     else ""))
  if "serve_load" in result["suites"]:
    sl = result["suites"]["serve_load"]
    ms = lambda x: "-" if x is None else _fmt(1e3 * x)
    s, o = sl["served"], sl["offline"]
    lines += ["", f"`hisparse-jax serve` under load (`serve_load`): {sl['num_clients']} "
              "concurrent streaming clients on loopback, retrieval prompts of "
              f"{'/'.join(str(x) for x in sl['config']['context_lens'])} tokens, "
              f"{'/'.join(str(x) for x in sl['config']['max_tokens'])} new tokens, greedy, "
              f"engine flags `{' '.join(sl['config']['engine_flags'])}`, median of "
              f"{sl['config']['reps']} rounds alternated with the same requests through "
              f"`LLM.generate` (rounds served: "
              f"{', '.join(_fmt(x) for x in sl['served_round_seconds'])} s):", "",
              "| side | s | requests/s | output tokens/s | TTFT p50 ms | TTFT p99 ms "
              "| ITL p50 ms | ITL p99 ms |", "|---|---|---|---|---|---|---|---|",
              f"| served | {_fmt(s['seconds'])} | {_fmt(s['requests_per_s'])} | "
              f"{_fmt(s['output_tokens_per_s'])} | {ms(s['ttft_s']['p50'])} | "
              f"{ms(s['ttft_s']['p99'])} | {ms(s['itl_s']['p50'])} | {ms(s['itl_s']['p99'])} |",
              f"| offline | {_fmt(o['seconds'])} | {_fmt(o['requests_per_s'])} | "
              f"{_fmt(o['output_tokens_per_s'])} | - | - | - | - |"]
  if "decode_sparse_vs_dense" in result["suites"]:
    d = result["suites"]["decode_sparse_vs_dense"]
    lines += ["", f"Decode step, batch {d['batch']}, block size {d['block_size']}, top-k "
              f"{d['top_k_tokens']:,} tokens, {d['model']['num_hidden_layers']} layers, "
              f"{d['model']['num_attention_heads']} query / {d['model']['num_key_value_heads']} "
              f"KV heads of {d['model']['head_dim']}, {d['kv_dtype']} KV "
              f"(backend {d['kernel_backend']}):", "",
              "| context | dense ms | sparse ms | dense / sparse | bytes_bound | of bound "
              "| bound with weights |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['context']:,} | {_fmt(r['dense_ms'])} | {_fmt(r['sparse_ms'])} | "
              f"{_fmt(r['dense_over_sparse'])} | {_fmt(r['bytes_bound'])} | "
              f"{100 * r['fraction_of_bound']:.0f}% | {_fmt(r['bytes_bound_with_weights'])} |"
              for r in d["rows"]]
  if "hisparse_hot_buffer" in result["suites"]:
    h = result["suites"]["hisparse_hot_buffer"]
    lines += ["", f"HiSparse decode step at hot-buffer hit rates (`hisparse_hot_buffer`): batch "
              f"{h['batch']} x {h['context']:,} tokens offloaded to the pinned_host pool, "
              f"top-k {h['top_k_tokens']:,} tokens ({h['top_k_blocks']} blocks), hot buffer "
              f"{h['hot_buffer_blocks']} blocks, {h['num_layers']} layers, "
              f"{h['rates'][0]['block_bytes']:,} bytes per block and layer; loads: "
              f"{h['loads']}:", "",
              "| hit rate | measured | step ms | missed block-layers | loaded block-layers "
              "| h2d MiB / step |", "|---|---|---|---|---|---|"]
    lines += [f"| {100 * r['hit_rate']:.0f}% | {100 * r['measured_hit_rate']:.1f}% | "
              f"{_fmt(r['step_ms'])} | {r['missed_blocks_per_step']:,} | "
              f"{r['loaded_blocks_per_step']:,} | {r['h2d_bytes_per_step'] / 2**20:.2f} |"
              for r in h["rates"]]
  if "passkey" in result["suites"]:
    lines += passkey_lines(result["suites"]["passkey"])
  if "hisparse_throughput" in result["suites"]:
    lines += throughput_lines(result["suites"]["hisparse_throughput"])
  if "dsa_decode" in result["suites"]:
    lines += dsa_decode_lines(result["suites"]["dsa_decode"])
  return "\n".join(lines)


def dsa_decode_lines(d: dict) -> list[str]:
  """The dsa_decode suite: a DSA model's decode step against dense MLA, by context."""
  m = d["model"]
  lines = ["", f"DSA decode step (`dsa_decode`): batch {d['batch']}, {m['num_hidden_layers']} "
           f"layers, {m['num_attention_heads']} heads over a latent of {m['kv_lora_rank']} + "
           f"{m['qk_rope_head_dim']}, indexer {m['index_n_heads']} heads x "
           f"{m['index_head_dim']}, index_topk {d['index_topk']:,}, {d['kv_dtype']} caches, "
           f"block size {d['block_size']}, backend {d['kernel_backend']}; offloaded: every "
           f"block in the pinned_host pool, only the newest on the device, a hot buffer of "
           f"{d['hot_buffer_tokens']:,} tokens (warm: holding the last step's selection; cold: "
           "emptied before each step):", "",
           "| context | dense MLA ms | DSA resident ms | DSA offloaded ms | cold ms "
           "| dense / offloaded | dense / cold | bytes_bound | cold tokens loaded |",
           "|---|---|---|---|---|---|---|---|---|"]
  eight = d.get("index_cache_dtype_8bit")
  if eight:  # (the resident step over 8-bit indexer keys, since session 38)
    lines[-2] = lines[-2].replace("| DSA offloaded", f"| resident, {eight} indexer keys ms "
                                  "| DSA offloaded")
    lines[-1] += "---|"
  lines += [f"| {r['context']:,} | {_fmt(r['dense_ms'])} | {_fmt(r['resident_ms'])} | "
            + (f"{_fmt(r['resident_8bit_ms'])} | " if eight else "")
            + f"{_fmt(r['offloaded_ms'])} | {_fmt(r['offloaded_cold_ms'])} | "
            f"{_fmt(r['dense_over_offloaded'])} | {_fmt(r['dense_over_offloaded_cold'])} | "
            f"{_fmt(r['bytes_bound'])} | {r['cold_step_tokens_loaded']:,} |"
            for r in d["rows"]]
  return lines


def throughput_lines(t: dict) -> list[str]:
  """The hisparse_throughput suite: each engine on the workload, then the sweep (a long
  size: its rows by length)."""
  if "lengths" in t:
    return throughput_long_lines(t)
  size = t["size"]
  low, high = size["prompt_lens"]
  vllm = t["engines"].get("vLLM")
  if not size["num_requests"]:  # --bench_size=sweep: the sweep only
    lines = ["", f"HiSparse throughput sweep (`hisparse_throughput --bench_size=sweep`): "
             f"{size['model']}, {size['kv_gib']:g} GiB of device KV for both engines, "
             f"HiSparse top-k {size['top_k_tokens']:,} with a {size['host_pool_gib']:g} GiB "
             f"host pool, {size['long_tokens']} new tokens per request, greedy; decode "
             "tokens/s over the steps that schedule no prompt token:"]
    return lines + _sweep_lines(t)
  lines = ["", f"HiSparse throughput (`hisparse_throughput`): {size['model']}, "
           f"{size['kv_gib']:g} GiB of device KV for every engine, {size['num_requests']} "
           f"requests of {low:,}-{high:,} prompt tokens + {size['long_tokens']} new, greedy; "
           f"HiSparse top-k {size['top_k_tokens']:,} with a {size['host_pool_gib']:g} GiB host "
           "pool; decode tokens/s over the steps that schedule no prompt token (each engine's "
           "own step records), its share of the wall time, end-to-end tokens/s (prompt + "
           "generated over the wall time)"
           + (f"; vLLM {vllm.get('vllm_version', '')} CPU build, its threads at "
              f"VLLM_CPU_NUM_OF_RESERVED_CPU={vllm.get('VLLM_CPU_NUM_OF_RESERVED_CPU')}"
              if vllm else "") + ":", "",
           "| engine | decode tok/s | time decoding | e2e tok/s | at once | TTFT p50 / p99 ms "
           "| ITL p50 / p99 ms |", "|---|---|---|---|---|---|---|"]
  for name, r in t["rows"].items():
    lines.append(f"| {name} | {_fmt(r['decode_tokens_per_s'])} | "
                 f"{100 * r['decode_share']:.0f}% | {_fmt(r['e2e_tokens_per_s'])} | "
                 f"{r['max_running'] if r['max_running'] is not None else '-'} | "
                 f"{_fmt(r['ttft_p50_ms'])} / {_fmt(r['ttft_p99_ms'])} | "
                 f"{_fmt(r['itl_p50_ms'])} / {_fmt(r['itl_p99_ms'])} |")
  return lines + _sweep_lines(t)


def throughput_long_lines(t: dict) -> list[str]:
  """hisparse_throughput's long rows: per length, the three engines at one device budget
  (decode and e2e tokens/s, decoding at once, answers, host selections, offloads)."""
  size = t["size"]
  lines = ["", f"HiSparse admission by offload (`hisparse_throughput --bench_size="
           f"{size['name']}`): {size['model']}, {size['num_prompts']} passkey prompts at once "
           f"per length, a device pool of {size['device_prompts']} requests for every engine, "
           f"HiSparse top-k {size['top_k_tokens']:,} (hot buffer as large) with a host pool "
           f"of every request, {size['new_tokens']} new tokens, greedy; decode tokens/s over "
           "the steps that schedule no prompt token:", "",
           "| length | engine | decode tok/s | e2e tok/s | decoding at once | capacity line "
           "runs | right | host selections | offloads |", "|---|---|---|---|---|---|---|---|---|"]
  for row in t["lengths"]:
    for name, r in row["rows"].items():
      runs = r["hisparse_runs_at_once"]
      lines.append(f"| {row['length']:,} | {name} | {_fmt(r['decode_tokens_per_s'])} | "
                   f"{_fmt(r['e2e_tokens_per_s'])} | {r['max_decoding']} | "
                   f"{'-' if runs is None else runs} | {r['num_right']}/{len(r['answers'])} "
                   f"| {r['host_blocks_selected']:,.0f} | {r['offloads']:,.0f} |")
  return lines


def _sweep_lines(t: dict) -> list[str]:
  size = t["size"]
  dense, sparse = t["rows"]["device-only"]["sweep"], t["rows"]["HiSparse"]["sweep"]
  if not dense:  # --bench_size=workload: the workload rows only
    return []
  ratio = t["ratios"]["sweep_decode_vs_device_only"]
  calls = all("rounds_decode_tokens_per_s" in r for r in (*dense.values(), *sparse.values()))
  if not calls:  # (runs before the sweep alternated the engines: one timed call each)
    lines = ["", f"Concurrency sweep, {size['sweep_prompt_len']:,}-token prompts, the same "
              "engines (decode tokens/s):", "",
              "| at once | device-only | HiSparse | HiSparse / device-only |",
              "|---|---|---|---|"]
    lines += [f"| {c} | {_fmt(dense[c]['decode_tokens_per_s'])} | "
              f"{_fmt(sparse[c]['decode_tokens_per_s'])} | {_fmt(ratio[c])} |" for c in dense]
    return lines
  lines = ["", f"Concurrency sweep, {size['sweep_prompt_len']:,}-token prompts, the same "
           "engines, both up at once and taking turns at each level (the order flips every "
           "round); decode tokens/s of the median timed call, and of every call in the order "
           "run:", "",
           "| at once | device-only | HiSparse | HiSparse / device-only | device-only calls "
           "| HiSparse calls |", "|---|---|---|---|---|---|"]
  each = lambda r: ", ".join(_fmt(x) for x in r["rounds_decode_tokens_per_s"])  # noqa: E731
  lines += [f"| {c} | {_fmt(dense[c]['decode_tokens_per_s'])} | "
            f"{_fmt(sparse[c]['decode_tokens_per_s'])} | {_fmt(ratio[c])} | {each(dense[c])} "
            f"| {each(sparse[c])} |" for c in dense]
  return lines


def passkey_lines(p: dict) -> list[str]:
  """The passkey suite: accuracy by length and configuration, the host loads of each row,
  the smallest top-k keeping dense accuracy, greedy agreement."""
  c = p["config"]
  pct = lambda x: f"{100 * x:.0f}%"  # noqa: E731
  depth_sets = {}
  for r in p["rows"]:
    depth_sets.setdefault(r["length"], r["num_prompts"])
  configs = [(k, b) for k in c["top_ks"] for b in c["block_sizes"]]
  by_key = {(r["length"], r["top_k_tokens"], r["block_size"]): r for r in p["rows"]
            if not r.get("streamed")}
  selection = ", ".join(sorted({f"`{r['hisparse']['selection']}`" for r in p["rows"]
                                if r.get("hisparse")})) or "-"

  def cell(r):
    if r is None:
      return "-"
    if r["status"] != "run":
      return r["status"]
    return f"{r['num_right']}/{r['num_prompts']}"

  lines = ["", f"Passkey retrieval (`passkey`): {p['model']} ({p['checkpoint']['file']}, "
           f"float32), Quest's template, {c['new_tokens']} greedy tokens, a 5-digit key per "
           "prompt at depths "
           f"{'/'.join(pct(d) for d in c['depths'])}; a length is prompt + generated tokens. "
           f"The query's last tokens ({c['forced_tail'].strip()!r}) and the answer are "
           "computed by decode steps, sparse ones with HiSparse (every request is longer than "
           "its threshold, = top-k). All depths of a length run as one batch over a device "
           f"pool of {c['device_requests']} requests' blocks (HiSparse rows whose hot buffer "
           "is over a quarter of a request: one request + the hot buffer + "
           f"{c.get('offload_slack', 0.25)} of a request, so that an offload can admit the "
           "next request); HiSparse offloads to admit the "
           "next one (hot buffer = top-k) and loads the selected blocks back from the host "
           "pool. `covers`: top-k >= length (every block selected: dense by construction, "
           f"not run); `-`: not run. HiSparse selection: {selection}. "
           f"{p['seconds']:,.0f} s in all.", "",
           "| length | prompts | dense | "
           + " | ".join(f"top-k {k:,} b{b}" for k, b in configs)
           + " | smallest top-k keeping dense |",
           "|---" * (len(configs) + 4) + "|"]
  for length, n in depth_sets.items():
    dense = by_key[(length, None, c["dense_block_size"])]
    smallest = ", ".join(f"b{b}: {'none' if k is None else f'{k:,}'}"
                         for b, k in p["smallest_top_k"][str(length)].items())
    lines.append(f"| {length:,} | {n} | {cell(dense)} | "
                 + " | ".join(cell(by_key.get((length, k, b))) for k, b in configs)
                 + f" | {smallest} |")
  lines += ["", "Each row (answers in depth order, `*` wrong, `-` no number; host loads = "
            "block-layers loaded from the host pool into hot buffers inside the steps):", "",
            "| length | config | right | answers | host loads | offloads | hot-buffer hit "
            "ratio | h2d MiB | s |", "|---|---|---|---|---|---|---|---|---|"]
  for r in p["rows"]:
    if r["status"] != "run":
      continue
    h = r["host"]
    answers = " ".join(f"{a['answer'] or '-'}{'' if a['right'] else '*'}" for a in r["answers"])
    lines.append(f"| {r['length']:,} | {r['config']} | {r['num_right']}/{r['num_prompts']} | "
                 f"{answers} | {h['host_loads']:,.0f} | {h['offloads']:,.0f} | "
                 f"{pct(h['hot_buffer_hit_ratio']) if h['hot_buffer_lookups'] else '-'} | "
                 f"{h['h2d_bytes'] / 2**20:,.1f} | "
                 f"{r['engine_s'] + r['run_s']:,.0f} |")
  streamed = [r for r in p["rows"] if r.get("streamed")]
  if streamed:
    fraction = streamed[0]["config"].rsplit("(", 1)[1].split(",")[0].rstrip(")")
    modes = {r.get("streamed_prefill") or "sparse" for r in streamed}
    how = {"exact": "`exact prefill`: each later chunk attends over all its earlier blocks "
                    "(the dropped ones loaded back from the host pool in groups through its "
                    "hot buffer) and its own, as dense prefill does",
           "sparse": "`sparse prefill`: each later chunk attends over the top-k of its "
                     "earlier blocks and densely over its own"}
    lines += ["", f"`streamed`: the same HiSparse row with a device pool of {fraction} of "
              "one request's blocks, less than half of each prompt's KV: every prompt streams "
              "through it (its computed chunks written through to the host pool and "
              "dropped); dense cannot start at that budget. "
              + "; ".join(how[m] for m in sorted(modes)) + "."]
  a = p["agreement"]
  if a is None:
    return lines
  lines += ["", f"Greedy agreement with dense: {len(a['prompts'])} ordinary English prompts "
            f"in the chat template ({min(a['prompt_tokens'])}-{max(a['prompt_tokens'])} "
            f"tokens), {a['new_tokens']} tokens each, every one from a decode step (the "
            "prompt's last token fed as one); HiSparse with sparse_threshold_tokens = top-k, "
            "so the steps are sparse:", "",
            "| config | tokens equal to dense | identical | mean common prefix | sparse steps "
            "| context attended |", "|---|---|---|---|---|---|"]
  lines += [f"| {r['config']} | {r['tokens_equal']}/{r['tokens_compared']} | "
            f"{r['identical']}/{len(a['prompts'])} | {r['common_prefix_mean']:.1f} | "
            f"{pct(r['sparse_step_fraction'])} | {pct(r['context_attended_mean'])} |"
            for r in a["rows"]]
  return lines


def main(argv: list[str]) -> int:
  if len(argv) != 2:
    print("usage: python -m hisparse_jax.bench.report BENCH.json", file=sys.stderr)
    return 2
  with open(argv[1]) as f:
    print(markdown(json.load(f)))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
