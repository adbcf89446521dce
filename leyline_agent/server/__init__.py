"""``leyline serve``: the embedded engine behind an OpenAI-compatible HTTP API.

Layers, one job each:

- ``worker``: ``Worker``, which starts every piece of engine work in arrival order on up to
  ``concurrency`` threads (one session's work one at a time); ``ServedEngine``, the protocol an
  engine serves through.
- ``openai_api`` (wire models) -> ``completions`` (checks, sampling parameters) ->
  ``openai_routes`` (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``),
  with ``streaming`` (SSE, the text deltas of a streamed answer), ``tool_calls`` and
  ``logprobs``.
- ``leyline_routes``: ``POST /leyline/v1/directives``, ``GET /leyline/v1/stats``, with
  ``directive_memory`` (idempotent ``request_id`` retries).
- ``tenants`` (API keys, ``Host`` allowlist, each request's namespace), ``limits`` (body
  size, prompt tokens before tokenizing), ``inputs`` (text that is not Unicode),
  ``disconnect`` (work for a client that left is cancelled or stopped).
- ``errors``: every failure -> ``{"error": ErrorBody}`` with a 4xx/5xx status.
- ``app.create_app(engine_or_worker, ...)``; ``main.serve(args)`` runs uvicorn;
  ``cli`` registers ``leyline serve`` (``--engine sglang`` hands over to the SGLang plugin).

Nothing is imported here: ``leyline_agent.server.app`` pulls in FastAPI, and the engine
pulls in torch.
"""
