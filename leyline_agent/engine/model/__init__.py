"""The model the engine runs: ``loader`` (a local Hugging Face checkpoint in) and ``runner``
(transformers forwards over prefixes gathered from the KV pool). What differs between model
families is read from ``leyline_agent.families``."""
