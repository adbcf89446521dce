"""The agent side: what runs inside the user's agent loop (no torch, no serving code).

- ``session.ContextSession``: runs a ``PolicyPipeline`` on the agent's history, keeps its
  edits sticky, and says which cached messages changed (a message-form directive request).
- ``wrappers.wrap_openai``: the same, around an OpenAI / AsyncOpenAI client.
- ``transport.LeylineTransport``: the same as an httpx transport (sync and async in one),
  below the SDK: its copies, raw and streaming responses keep it; sessions by content.
- ``stream_observer``: a streamed reply passed through and assembled for the session.
- ``http_runtime.HTTPRuntime`` / ``AsyncHTTPRuntime``: the ``Runtime`` protocol over HTTP;
  the one place that turns an OpenAI base URL (``.../v1``) into the server root.

Imports go down only: this package uses the contracts and ``leyline_agent.policies``.
"""
