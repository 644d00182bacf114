"""The engine loop: requests in, tokens out, one step at a time.

  engine.py            Engine: add_request / step / abort_request; its step reads as the
                       algorithm: schedule -> move blocks -> build batch -> run ->
                       postprocess (of the step before: steps overlap)
  config.py            EngineConfig (validated; the CLI's flags), default_block_size
  request.py           Request (one sequence's state machine), SequenceGroup (n > 1),
                       vLLM's output shapes (RequestOutput, CompletionOutput, ...)
  sampling.py          SamplingParams + the batched sampler (inside the step)
  scheduler.py         FCFS continuous batching, chunked prefill, swap-out preemption,
                       HiSparse write-through / offload / admission
  output_processor.py  sampled tokens -> output ids, text, logprobs, stops; RequestOutputs
  hot_rows.py          HotRows: which hot-buffer state row each offloaded sequence holds
  runner.py            ModelRunner: the device state between steps, dispatch / collect
  step_batch.py        BatchBuilder: the scheduled chunks as padded step arrays (host)
  step_program.py      the jitted step (forward + sampling) and the copy / refresh programs
  step_shapes.py       StepCompiler: new step shapes compiled in the background (serve)
  warmup.py            warm_up: a lone request's programs compiled before the first request
                       (serve, before "serving on"; nothing runs, nothing changes)

May import: sparse, kv_cache, distributed, observability, models, kernels_pallas.
Never entrypoints or bench.
"""
