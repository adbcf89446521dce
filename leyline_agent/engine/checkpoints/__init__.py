"""Checkpoints Leyline builds itself: ``modelgen`` (``leyline make-model``: seeded
random-weight models), ``toy_tokenizer`` (a byte-level BPE trained locally, ChatML template
with Hermes tool calls) and ``store`` (each (arch, size, seed) built once per machine)."""
