"""The HTTP guards every Leyline front runs (``leyline serve``, the vLLM and SGLang plugins).

- ``guards``: body size, API key (``Authorization: Bearer`` and the Messages routes'
  ``x-api-key``), JSON and text checks, and their error answers.
- ``asgi``: raw ASGI plumbing the fronts' middleware share (types, headers, JSON answers,
  answer rewriting).

No torch, no web framework.
"""
