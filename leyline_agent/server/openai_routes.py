"""``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``: OpenAI-compatible routes.

A request is checked (``completions.py``; ``tool_choice`` and ``response_format`` become the
grammar its answer is sampled under, ``tool_choice.py`` and ``response_format.py``), its
prompt rendered or tokenized on the worker, its sampling parameters built, and then generated on the worker: in one
job (JSON answer) or streamed as server-sent events, ``data: {chunk}`` per delta and
``data: [DONE]`` at the end; with ``stream_options.include_usage`` a last chunk with empty
``choices`` carries ``usage``. The response starts once the generation job runs, so what
fails before that (a bad value, the queue timeout) is an ordinary error answer; an error
after the stream has started is sent as one ``data: {"error": ...}`` event (the OpenAI
client raises it).

Every engine job watches its client: if it disconnects, a queued job never runs and a
running generation stops at its next token, before the engine caches or counts anything
(``disconnect``). Each request's namespace (tenant, session) goes to ``engine.generate``;
a generation of a named session runs in that session's order (``worker.session_key``),
other requests side by side on the worker's threads (their steps batched by the engine).
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from leyline_agent.directives.body_edits import outcome, request_edits
from leyline_agent.engine.params import GenerationResult, SamplingParams, TokenLogprob
from leyline_agent.errors import ModelNotFoundError
from leyline_agent.http_errors import error_body
from leyline_agent.namespaces import Namespace
from leyline_agent.server import logprobs as lp
from leyline_agent.server.chat_context import PreparedChat, prepare_chat
from leyline_agent.server.completions import (
    check_messages,
    check_prompt_ids,
    check_prompt_length,
    completion_prompt,
    messages_for_template,
    sampling_params,
)
from leyline_agent.server.disconnect import (
    GenerationCancelled,
    run_connected,
    stop_when_gone,
    while_connected,
)
from leyline_agent.server.errors import RequestError, classify, exception_code
from leyline_agent.server.inputs import ParsedBodyRoute
from leyline_agent.server.limits import check_text_bound, message_text_bytes
from leyline_agent.server.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    model_card,
    new_id,
    now,
    usage,
)
from leyline_agent.server.request_fields import (
    fields_check,
    ignore,
    ignored,
)
from leyline_agent.server.schema_work import answer_constraints
from leyline_agent.server.session_names import name_session
from leyline_agent.server.state import ServerState, state
from leyline_agent.server.streaming import DONE, StreamedText, sse
from leyline_agent.server.structured_outputs import completion_grammar, structured_format
from leyline_agent.server.template_options import template_options
from leyline_agent.server.tenants import namespace
from leyline_agent.server.tool_calls import ParsedOutput, ResponseStream, served_format
from leyline_agent.server.tool_choice import (
    ToolChoice,
    answer_stream,
    check_met,
)
from leyline_agent.server.worker import ServedEngine, StreamEnd, session_key

__all__ = ["router"]

router = APIRouter(route_class=ParsedBodyRoute)  # a large body parsed off the loop
PROMPT_TAIL = 24  # prompt tokens decoded for what the generation prompt wrote of the answer


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    m = state(request).model
    return {"object": "list", "data": [model_card(m.id, m.created)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    m = state(request).model
    if model_id != m.id and model_id not in m.aliases:
        raise ModelNotFoundError(f"the model {model_id!r} does not exist", "model")
    return model_card(m.id, m.created)


def _answer_tokens(result: GenerationResult, st: ServerState) -> int:
    """The answer's tokens as OpenAI and vLLM count and list them: without the stop token
    it ended on (which stays in ``output_ids``: the cache holds it, as the next turn's
    rendering does)."""
    n, stops = len(result.output_ids), getattr(st.worker.engine, "stop_token_ids", ())
    ended_on_stop = result.finish_reason == "stop" and n > 0 and result.output_ids[-1] in stops
    return n - 1 if ended_on_stop else n


def _listed(result: GenerationResult, st: ServerState) -> list[TokenLogprob]:
    """The log-probabilities of the answer's tokens (``_answer_tokens``)."""
    return (result.logprobs or [])[: _answer_tokens(result, st)]


def _usage(
    result: GenerationResult, st: ServerState, ctx: PreparedChat | None = None
) -> dict[str, Any]:
    """OpenAI's usage, plus ``leyline.splice_evicted``: the session's last splice result was
    evicted before this request could use it (so it was prefilled again); for a chat turn
    the server edited, what it spliced first (``chat_context``)."""
    out = usage(result.prompt_tokens, _answer_tokens(result, st), result.cached_tokens)
    out["leyline"] = {"splice_evicted": bool(getattr(result, "splice_evicted", False))}
    if ctx is not None:
        out["leyline"].update(ctx.usage)
    return out


def _finish(result: GenerationResult, called_tools: bool = False) -> str:
    reason = result.finish_reason if result.finish_reason in ("stop", "length") else "stop"
    return "tool_calls" if called_tools and reason == "stop" else reason


# ---- chat ------------------------------------------------------------------------------
@router.post(
    "/v1/chat/completions", dependencies=[Depends(fields_check("chat", ChatCompletionRequest))]
)
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
    name_session(request, req.prompt_cache_key, "prompt_cache_key")
    st, ns = _request_context(request, req.model)
    fmt = structured_format(req)  # vLLM's structured_outputs / guided_* (structured_outputs.py)
    if fmt is not None:
        req = req.model_copy(update={"response_format": fmt})
    tools = check_messages(req)
    render, notes = template_options(req, st.worker.engine)  # template_options.py
    ignore(request, notes)
    edits = request_edits(req.leyline, req.messages)  # leyline.edits checked and applied
    messages = messages_for_template(edits.messages)
    longest, limit = st.model.limits.longest_token_bytes, st.model.max_prompt_tokens
    check_text_bound(message_text_bytes(messages), longest, limit, "messages")
    done = await answer_constraints(  # schema_work.py: off the event loop, bounded
        st.worker.engine,
        req.tool_choice,
        tools,
        req.parallel_tool_calls,
        req.response_format,
        getattr(request.app.state, "leyline_schema_limits", None),
    )
    choice, forced, grammar = done.choice, done.forced, done.grammar
    cm, opts, declared = req.context_management, edits.options, edits.declared
    ctx = None
    if render.plain:  # a conversation is tracked as the template renders it by default
        ctx = await prepare_chat(
            request, st, edits.messages, cm, opts, tools, ns, declared=declared
        )  # server-side edits and splices (chat_context); None: served as it is
    elif cm is not None or req.leyline is not None:
        field = "context_management" if cm is not None else "leyline"
        raise RequestError(
            "server-side edits need the default rendering (no chat_template_kwargs, "
            "reasoning_effort, add_generation_prompt or continue_final_message)",
            field,
        )
    if ctx is not None:
        messages, ns = ctx.messages, ctx.namespace
        st.metrics.sources.turn(ctx.body["leyline"], ctx.usage)  # splices by source
        if edits.edits:  # what came of leyline.edits, in the answer's leyline field
            done = outcome(edits, ctx.body["leyline"]["edited_messages"], ns.session or "")
            ctx.body["leyline"]["edits"] = done
    ids = await run_connected(
        request,
        st.worker,
        lambda e: (
            (
                e.render(messages, tools=tools, add_generation_prompt=True)
                if render.plain
                else e.render(
                    messages,
                    tools=tools,
                    add_generation_prompt=render.add_generation_prompt,
                    template_kwargs=render.kwargs,
                )
            )
            + (list(e.tokenizer.encode(forced, add_special_tokens=False)) if forced else [])
        ),
    )
    check_prompt_ids(ids, st.model.limits, "messages")
    params = sampling_params(req, len(ids), st.model, grammar)
    served = served_format(st.worker.engine)  # the family's format (families.py)
    tail = st.worker.engine.tokenizer.decode(ids[-PROMPT_TAIL:]) if served[1] else ""
    stream = answer_stream(choice, tools, served, tail)  # tool_calls.py: the parse
    if req.stream:
        events = await _started(request, _generate(st, ids, params, stream, ns))
        events_ = _chat_events(st, req, events, params, stream, choice, ctx, ignored(request))
        return _event_stream(events_)
    result = await _generate_once(request, st, ids, params, ns)
    stream.push(result.text)
    truncated = result.finish_reason == "length"  # answered as it is (tool_choice.py)
    _, parsed = stream.finish(truncated)
    check_met(choice, parsed.tool_calls, stream.fed, truncated)  # 422: a forced call missing
    message = _message(parsed)
    choice = {
        "index": 0,
        "message": message,
        "logprobs": lp.chat(_listed(result, st)) if params.logprobs else None,
        "finish_reason": _finish(result, bool(parsed.tool_calls)),
    }
    body = {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": now(),
        "model": st.model.id,
        "choices": [choice],
        "usage": _usage(result, st, ctx),
        "system_fingerprint": None,
    }
    if ctx is not None:
        body.update(ctx.body)
        ctx.commit(message, result.prompt_ids + result.output_ids)  # the ids it cached
    return JSONResponse(_with_ignored(body, ignored(request)))


def _message(parsed: ParsedOutput) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content, "refusal": None}
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    if parsed.reasoning_content is not None:
        message["reasoning_content"] = parsed.reasoning_content
    return message


async def _chat_events(
    st: ServerState,
    req: ChatCompletionRequest,
    events: AsyncIterator[str | StreamEnd[GenerationResult]],
    params: SamplingParams,
    stream: ResponseStream,
    choice: ToolChoice,
    ctx: PreparedChat | None = None,
    notes: list[dict[str, str]] | None = None,
) -> AsyncIterator[str]:
    out = _Stream(st, req, "chatcmpl", "chat.completion.chunk", {"system_fingerprint": None})
    first = {**out.head, **ctx.body} if ctx is not None else out.head  # what the server edited
    first = _with_ignored(first, notes or [])  # and the fields it did not act on

    def chunk(
        delta: dict[str, Any],
        finish: str | None = None,
        logprobs: dict[str, Any] | None = None,
        top: dict[str, Any] | None = None,
    ) -> str:
        choice = {"delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return out.frame(choice, top)

    yield chunk({"role": "assistant", "content": ""}, top=first)
    async for deltas in out.deltas(events):
        for name, value in deltas:
            yield chunk(_delta(name, value))
    result = out.result
    rest = stream.catch_up(result.text)
    truncated = result.finish_reason == "length"  # answered as it is (tool_choice.py)
    more, parsed = stream.finish(truncated)
    check_met(choice, parsed.tool_calls, stream.fed, truncated)  # in-band error: call missing
    rest += more
    logprobs = lp.chat(_listed(result, st)) if params.logprobs else None
    for name, value in rest[:-1] if logprobs and rest else rest:
        yield chunk(_delta(name, value))
    if logprobs:
        last = rest[-1] if rest else ("content", "")
        yield chunk(_delta(*last), logprobs=logprobs)
    yield chunk({}, finish=_finish(result, bool(parsed.tool_calls)))
    if ctx is not None:
        reply = {k: v for k, v in _message(parsed).items() if k != "refusal"}
        ctx.commit(reply, result.prompt_ids + result.output_ids)  # the ids it cached
    if out.include_usage:
        yield out.usage(_usage(result, st, ctx))


def _delta(name: str, value: Any) -> dict[str, Any]:
    """A chunk's delta: text of ``content`` / ``reasoning_content``, or one call's delta."""
    return {"tool_calls": [value]} if name == "tool_calls" else {name: value}


# ---- completions -----------------------------------------------------------------------
@router.post(
    "/v1/completions", dependencies=[Depends(fields_check("completions", CompletionRequest))]
)
async def completions(req: CompletionRequest, request: Request) -> Any:
    st, ns = _request_context(request, req.model)
    prompt = completion_prompt(req)
    if isinstance(prompt, str):
        size = len(prompt.encode("utf-8", "surrogatepass"))
        check_text_bound(
            size, st.model.limits.longest_token_bytes, st.model.max_prompt_tokens, "prompt"
        )
        ids = await run_connected(request, st.worker, lambda e: list(e.tokenizer.encode(prompt)))
    else:
        check_prompt_length(len(prompt), st.model, "prompt")
        ids = prompt  # token ids are used as given: no BOS, no template
    check_prompt_ids(ids, st.model.limits, "prompt")
    params = sampling_params(req, len(ids), st.model, completion_grammar(st.worker.engine, req))
    if req.stream:
        text = StreamedText()
        events = await _started(request, _generate(st, ids, params, text, ns))
        notes = ignored(request)
        return _event_stream(_completion_events(st, req, events, params, text, notes))
    result = await _generate_once(request, st, ids, params, ns)
    choice = {
        "index": 0,
        "text": result.text,
        "logprobs": lp.legacy(_listed(result, st), params.top_logprobs)
        if params.logprobs
        else None,
        "finish_reason": _finish(result),
    }
    body = {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": now(),
        "model": st.model.id,
        "choices": [choice],
        "usage": _usage(result, st),
        "system_fingerprint": None,
    }
    return JSONResponse(_with_ignored(body, ignored(request)))


async def _completion_events(
    st: ServerState,
    req: CompletionRequest,
    events: AsyncIterator[str | StreamEnd[GenerationResult]],
    params: SamplingParams,
    text: StreamedText,
    notes: list[dict[str, str]],
) -> AsyncIterator[str]:
    out = _Stream(st, req, "cmpl", "text_completion")
    first = [_with_ignored(out.head, notes)]  # the first chunk lists the fields ignored

    def chunk(text: str, finish: str | None = None, logprobs: dict[str, Any] | None = None) -> str:
        top = first.pop() if first else None
        return out.frame({"text": text, "logprobs": logprobs, "finish_reason": finish}, top)

    async for delta in out.deltas(events):
        yield chunk(delta)
    result = out.result
    rest = text.finish(result.text)
    logprobs = lp.legacy(_listed(result, st), params.top_logprobs) if params.logprobs else None
    yield chunk(rest, finish=_finish(result), logprobs=logprobs)
    if out.include_usage:
        yield out.usage(_usage(result, st))


# ---- shared ----------------------------------------------------------------------------
def _with_ignored(body: dict[str, Any], notes: list[dict[str, str]]) -> dict[str, Any]:
    """``body`` with ``leyline.ignored`` listing ``notes`` (``request_fields``), if any."""
    if not notes:
        return body
    return {**body, "leyline": {**body.get("leyline", {}), "ignored": notes}}


def _request_context(request: Request, model: str) -> tuple[ServerState, Namespace]:
    """The server's state and the request's namespace (its session checked), then the
    model name checked against the served one."""
    st = state(request)
    ns = namespace(request)
    st.model.check(model)
    return st, ns


class _Stream:
    """What the chat and the completion event streams share: the chunks' head, their
    framing (``usage: null`` on each chunk when the last one carries it), the deltas."""

    def __init__(
        self,
        st: ServerState,
        req: ChatCompletionRequest | CompletionRequest,
        prefix: str,
        obj: str,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.head = {"id": new_id(prefix), "object": obj, "created": now(), "model": st.model.id}
        self.head.update(extra or {})
        self._result: GenerationResult | None = None

    @property
    def result(self) -> GenerationResult:
        """The generation's result, once ``deltas`` has ended."""
        assert self._result is not None  # set by ``deltas`` before it ends
        return self._result

    def frame(self, choice: dict[str, Any], top: dict[str, Any] | None = None) -> str:
        body = {**(top or self.head), "choices": [{"index": 0, **choice}]}
        return sse({**body, "usage": None} if self.include_usage else body)

    def usage(self, usage: dict[str, Any]) -> str:
        return sse({**self.head, "choices": [], "usage": usage})

    async def deltas(
        self, events: AsyncIterator[str | StreamEnd[GenerationResult]]
    ) -> AsyncIterator[str]:
        """The text deltas of ``events``; ``result`` is the generation's once they end."""
        async with aclosing(events):
            async for event in events:
                if isinstance(event, StreamEnd):
                    self._result = event.result
                elif event:
                    yield event
        assert self._result is not None  # _generate always ends with StreamEnd or raises


async def _generate_once(
    request: Request, st: ServerState, ids: list[int], params: SamplingParams, ns: Namespace
) -> GenerationResult:
    """One non-streamed generation, stopped if the client leaves (see the module doc)."""
    gone = threading.Event()
    on_token = stop_when_gone(gone)
    result = await run_connected(
        request,
        st.worker,
        lambda e: e.generate(ids, params, on_token=on_token, namespace=ns),
        gone,
        key=session_key(ns),
    )
    st.metrics.generation(result)
    return result


async def _generate(
    st: ServerState, ids: list[int], params: SamplingParams, text: StreamedText, ns: Namespace
) -> AsyncIterator[str | StreamEnd[GenerationResult]]:
    """``""`` when the job starts, text deltas (the engine's, through ``text``), then
    ``StreamEnd``.

    If the consumer stops early (the client disconnected), a queued job never runs and a
    running one is stopped at its next token, before the engine caches or counts anything.
    """
    gone = threading.Event()

    def on_token(emit: Callable[..., None], token_id: int, delta: str = "") -> None:
        if gone.is_set():
            raise GenerationCancelled("the client disconnected")
        emit(text.push(delta))

    def job(engine: ServedEngine, emit: Callable[..., None]) -> GenerationResult:
        emit("")
        return engine.generate(ids, params, on_token=partial(on_token, emit), namespace=ns)

    try:
        async with aclosing(st.worker.stream(job, key=session_key(ns))) as events:
            async for event in events:
                if isinstance(event, StreamEnd):
                    st.metrics.generation(event.result)
                yield event if isinstance(event, StreamEnd) else event[0]
    finally:
        gone.set()


async def _started(
    request: Request, events: AsyncIterator[str | StreamEnd[GenerationResult]]
) -> AsyncIterator[str | StreamEnd[GenerationResult]]:
    """``events`` once its job runs: until then the client is watched and a failure (the
    queue timeout) is raised here, before any response header is sent."""
    try:
        await while_connected(request, anext(events), lambda: None)
    except BaseException:
        await events.aclose()
        raise
    return events


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    async def framed() -> AsyncIterator[str]:
        try:
            async with aclosing(events) as items:
                async for item in items:
                    yield item
        except Exception as exc:  # headers are gone: report in-band, as OpenAI does
            status, type_, message, field = classify(exc)
            body = error_body(type_, message, field, exception_code(exc, type_), status=status)
            yield sse({"error": body.model_dump()})
        yield DONE

    return StreamingResponse(
        framed(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
