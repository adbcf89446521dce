"""The embedded runtime: transformers models with a radix prefix cache and KV splices.

Layers, top to bottom (each file one job; importing this package imports no torch):

- ``engine.Engine``         facade: generate, apply_directives, stats, render
- ``directives_exec``       validate + compile a DirectivesRequest, then plan, then mutate
- ``compile``               message edits -> token spans (pure)
- ``splice``                SplicePlan (pure) and its execution on slots
- ``radix.RadixCache``      token ids -> slot indices (LRU, locks); no tensors
- ``allocator``             which slot indices are free
- ``kv_pool.KVPool``        the bytes: [layers, heads, slots, dim] keys / values
- ``runner.ModelRunner``    transformers forwards over prefixes gathered from the pool
- ``sampling``              SamplingParams, GenerationResult, token choice, stop strings
- ``loader`` / ``modelgen`` / ``tokenizer``   checkpoints in and out
"""
