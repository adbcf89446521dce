"""The Leyline front of a chat route, the same on every engine (no torch, no web framework).

- ``conversations``: the conversations a server has served, found again by content, per
  tenant and named session, with the reply-echo proof of provenance.
- ``context_management``: Anthropic's ``context_management`` and Leyline's ``leyline``
  options, checked (``clear_thinking``: its thinking-span policy).
- ``turns``: one turn's pure plan (sticky edits, client edits, policies) and its execution.
- ``chat_turn``: a tracked chat turn from the request to the answer's fields and commit.
- ``messages``: Anthropic's Messages API as a chat request and back.
- ``chat_proxy``, ``messages_proxy``, ``replies``: the same turn and Messages transport in
  front of an engine's own chat route, as raw ASGI (the vLLM plugin's middleware).

``leyline serve`` (``server/chat_context.py``) and ``vllm serve`` + the plugin
(``front/chat_proxy.py``) are its transports.
"""
