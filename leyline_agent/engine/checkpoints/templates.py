"""Chat templates ``leyline make-model --template`` writes with a checkpoint.

- ``chatml``: the toy tokenizer's ChatML + Hermes tool calls (``toy_tokenizer.CHAT_TEMPLATE``);
- ``reasoning``: Qwen3-style thinking. An assistant message after the last user message is
  rendered with a think block first, ``<think>\\n{reasoning}\\n</think>\\n\\n{content}``
  (``reasoning_content``, or the ``<think>...</think>`` the content opens with; an empty block
  when it has none); earlier assistant messages lose their thinking. So once a new user
  message arrives, every earlier turn's thinking is dropped from the prompt (a deletion
  against what was cached), and a reply sent back without its reasoning gets an empty block
  (an insertion);
- ``reasoning_kept``: the same, but every assistant message that has thinking keeps it (the
  hand-edited template users write to keep the prefix cache; it costs context);
- ``dated``: ChatML with a head line, ``Today: YYYY-MM-DD`` (transformers' ``strftime_now``),
  before everything else, as Llama 3.1's templates write one: it changes once a day, at
  token 3 of every prompt.
"""

from __future__ import annotations

from leyline_agent.engine.checkpoints.toy_tokenizer import CHAT_TEMPLATE

__all__ = ["TEMPLATES"]

_ASSISTANT_CHATML = "<|im_start|>assistant\n{{ message['content'] or '' }}"
_ASSISTANT_REASONING = (
    "{% set content = message['content'] or '' %}"
    "{% set reasoning = message.get('reasoning_content') or '' %}"
    "{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{% endif %}"
    "<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_user %}"
    "<think>\n{{ reasoning.strip('\\n') }}\n</think>\n\n"
    "{% endif %}"
    "{{ content }}"
)
_LAST_USER = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}"
    "{% endif %}{% endfor %}"
)


def _reasoning() -> str:
    if _ASSISTANT_CHATML not in CHAT_TEMPLATE:  # the toy template changed: say so, loudly
        raise RuntimeError("toy_tokenizer.CHAT_TEMPLATE no longer renders assistant content")
    body = CHAT_TEMPLATE.replace(_ASSISTANT_CHATML, _ASSISTANT_REASONING)
    body = body.replace(
        "{% if loop.first and not message['content'] %}", "{% if loop.first and not content %}"
    )
    return _LAST_USER + body


TEMPLATES: dict[str, str] = {
    "chatml": CHAT_TEMPLATE,
    "reasoning": _reasoning(),
    "reasoning_kept": _reasoning().replace(
        "{% if loop.index0 > ns.last_user %}", "{% if loop.index0 > ns.last_user or reasoning %}"
    ),
    "dated": "Today: {{ strftime_now('%Y-%m-%d') }}\n" + CHAT_TEMPLATE,
}
