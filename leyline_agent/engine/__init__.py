"""The embedded inference engine: transformers models, a prefix cache with provenance, splices.

One job per module, top to bottom (importing this package imports no torch):

- ``engine.Engine``       the facade: ``generate``, ``apply_directives`` (execute a request
                          on the cache), ``stats``, ``render``; thread-safe
- ``stepper``             the step loop shared by concurrent generations: schedule, run one
                          batched forward, sample (``scheduler``: which sequences step;
                          ``sequence``: a request's state)
- ``executor``            a ``DirectivesRequest``: compile (``directives.compile``), match,
                          plan, then mutate
- ``splice``              ``SplicePlan`` (pure) and its execution on slots
- ``params``              ``SamplingParams``, ``GenerationResult`` (torch-free)
- ``sampler``             token choice and logprobs (torch)
- ``detokenizer``         incremental text with stop strings (one per generation)
- ``cache/``              ``PrefixCache`` = radix tree (indices) + slot allocator + KV pool
                          (bytes) + budget + pins
- ``model/``              ``loader`` (a checkpoint in), ``runner`` (batched forwards whose
                          attention reads the pool by slot: ``attention``, ``context``)
- ``checkpoints/``        ``leyline make-model``: seeded checkpoints and the toy tokenizer

What a model family is (MLA or not, stop tokens, message boundary, tool-call format) is read
from ``leyline_agent.families``. The engine imports the contracts, ``directives`` and
``kernels``; nothing here imports the server, the SGLang plugin or the policies.
"""
