"""Ground-truth oracles: independent computations that the tests and ``leyline check``
compare Leyline against. None of them uses the engine's cache, pool, splice or kernels.

- ``kv_reference``: splices rebuilt from the model's own modules (forward hooks on the
  pre-RoPE projections, the model's own rotary function at absolute positions).
- ``hf_reference``: plain Hugging Face greedy decoding, full recomputation at every step.
- ``cache_oracle``: what a provenance-aware prefix cache may serve (dictionaries over token
  prefixes), with ``kv_reference`` rows.
- ``rope_configs``: the RoPE settings of real checkpoints (DeepSeek YaRN, Llama 3), for the
  kernel tests and the kernel benchmark.
"""
