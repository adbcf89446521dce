"""Run debug-gym's own agents with their LLM calls routed through Leyline.

debug-gym's agents (froggy, ...) call ``llm(messages, tools)``; its ``HuggingFaceLLM`` counts
tokens with a local Hugging Face tokenizer and sends the request with an OpenAI client.
``LeylineHuggingFaceLLM`` changes exactly one thing: the OpenAI client it sends with is
``wrap_openai(OpenAI(...), policies=..., runtime=...)``, so the Leyline policies edit the
agent's context and the serving side splices its KV cache before each request. Or it sends
with ``OpenAI(http_client=...)`` given, e.g. ``httpx.Client(transport=LeylineTransport([...]))``
(the transport recipe of the other frameworks; then no ``policies`` here). Every
request of one LLM object names its session (``session_id``, default a fresh id per
object; ``X-Leyline-Session`` on the chat calls and the directives), so the server reuses
the spliced rows for it and for nobody else. The agent, its prompts, its history, its tools
and the environment are debug-gym's, unchanged.

Three deliberate differences from the parent class:
- a reply without a tool call gets a unique call id (``empty_tool_response_<n>``): debug-gym
  gives every such reply the same id ``empty_tool_response``, and a history with duplicate
  tool-call ids is refused by the policies' trajectory validator (the turn would then go
  out unedited); the agent's behaviour is unchanged (the environment answers the unknown
  tool the same way);
- transport errors are not retried for minutes (debug-gym retries up to 100 times): an
  endpoint that is down surfaces at once as ``RuntimeUnavailableError``;
- the ``usage`` block of every response is kept in ``usage_log`` (prompt and cached tokens
  as the endpoint reports them), a cross-check for endpoints without ``/leyline/v1/stats``.

Importing this module imports debug-gym (and transformers, through ``HuggingFaceLLM``) but
never torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no network at import

import httpx  # noqa: E402
import openai  # noqa: E402
from debug_gym.llms.base import LLMConfig  # noqa: E402
from debug_gym.llms.huggingface import HuggingFaceLLM  # noqa: E402

from leyline_agent.agent.http_runtime import openai_base_url  # noqa: E402
from leyline_agent.errors import RuntimeUnavailableError  # noqa: E402

__all__ = ["LeylineHuggingFaceLLM", "make_llm_config"]

ClientWrapper = Callable[[openai.OpenAI], openai.OpenAI]


def _context_limit_k(tokenizer_dir: str | Path) -> int:
    """Context window in thousands of tokens (debug-gym's unit), from the model's config."""
    cfg = Path(tokenizer_dir) / "config.json"
    if cfg.is_file():
        n = json.loads(cfg.read_text()).get("max_position_embeddings")
        if isinstance(n, int) and n >= 1000:
            return n // 1000
    return 32


def make_llm_config(
    model: str,
    base_url: str,
    tokenizer: str | Path,
    *,
    context_limit_k: int | None = None,
    generate_kwargs: dict[str, Any] | None = None,
    api_key: str | None = None,
) -> LLMConfig:
    """The ``llm.yaml`` entry debug-gym would read, built in code (tag ``vllm`` = HF tokenizer)."""
    return LLMConfig(
        model=model,
        context_limit=context_limit_k or _context_limit_k(tokenizer),
        api_key=api_key or os.environ.get("OPENAI_API_KEY") or "leyline",
        endpoint=openai_base_url(base_url),
        tokenizer=str(tokenizer),
        tags=["vllm", "leyline"],
        generate_kwargs=dict(generate_kwargs or {}),
    )


class LeylineHuggingFaceLLM(HuggingFaceLLM):
    """debug-gym's ``HuggingFaceLLM`` whose OpenAI client is wrapped by Leyline.

    ``wrap``: a function that wraps the plain client (``None``: send unwrapped, the
    baseline). ``policies`` / ``runtime`` build the default wrapper,
    ``wrap_openai(client, policies=..., runtime=..., session_id=...)``, when ``wrap`` is not
    given (``runtime=None``: an ``HTTPRuntime`` at the client's base URL). ``http_client``:
    the httpx client the OpenAI client sends with (default: the SDK's own).
    """

    def __init__(
        self,
        name: str,
        llm_config: LLMConfig,
        *,
        policies: Sequence[Any] = (),
        runtime: Any = None,
        wrap: ClientWrapper | None = None,
        session_id: str | None = None,
        logger: Any = None,
        runtime_generate_kwargs: dict[str, Any] | None = None,
        timeout_s: float = 300.0,
        http_client: httpx.Client | None = None,
    ) -> None:
        super().__init__(
            name,
            llm_config=llm_config,
            logger=logger,
            runtime_generate_kwargs=runtime_generate_kwargs,
        )
        if wrap is None and policies:
            wrap = _default_wrapper(list(policies), runtime, session_id)
        self._wrap = wrap
        self._timeout_s = timeout_s
        self._http_client = http_client
        self.usage_log: list[dict[str, int]] = []
        self._empty_calls = 0
        self.transcript: list[dict[str, Any]] = []  # last prompt sent + the reply to it
        self.tool_schemas: list[dict[str, Any]] = []

    @property
    def client(self) -> openai.OpenAI:
        if getattr(self, "_client", None) is None:
            plain = openai.OpenAI(
                api_key=self.config.api_key,
                base_url=self.config.endpoint,
                timeout=self._timeout_s,
                max_retries=1,
                http_client=self._http_client,
            )
            self._client = self._wrap(plain) if self._wrap is not None else plain
        return self._client

    def _perform_chat_completion(self, **kwargs: Any) -> Any:
        try:
            response = self.client.chat.completions.create(**kwargs)
        except (openai.APIConnectionError, openai.APITimeoutError) as e:
            raise RuntimeUnavailableError(
                f"LLM endpoint {self.config.endpoint} unreachable: {e}"
            ) from e
        usage = getattr(response, "usage", None)
        if usage is not None:
            details = getattr(usage, "prompt_tokens_details", None)
            self.usage_log.append(
                {
                    "prompt_tokens": int(usage.prompt_tokens or 0),
                    "completion_tokens": int(usage.completion_tokens or 0),
                    "cached_tokens": int(getattr(details, "cached_tokens", 0) or 0),
                }
            )
        return response

    def parse_tool_call_response(self, response: Any) -> Any:
        call = super().parse_tool_call_response(response)
        if response is None:
            self._empty_calls += 1
            call = dataclasses.replace(call, id=f"{call.id}_{self._empty_calls}")
        return call

    def generate(self, messages: list[dict[str, Any]], tools: Any, **kwargs: Any) -> Any:
        response = super().generate(messages, tools, **kwargs)
        self.transcript = [dict(m) for m in messages] + [self.convert_response_to_message(response)]
        self.tool_schemas = self.define_tools(tools) if tools else []
        return response

    def need_to_be_retried(self, exception: BaseException) -> bool:
        # Retry rate limits only; anything else (endpoint down, bad request) ends the call.
        return isinstance(exception, openai.RateLimitError)


def _default_wrapper(policies: list[Any], runtime: Any, session_id: str | None) -> ClientWrapper:
    from leyline_agent.agent.wrappers import wrap_openai

    def wrap(client: openai.OpenAI) -> openai.OpenAI:
        return wrap_openai(client, policies=policies, runtime=runtime, session_id=session_id)

    return wrap
