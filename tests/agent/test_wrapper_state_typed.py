"""The wrapped client's state accessor is typed: ``leyline_state(client) -> LeylineState``
and the ``LeylineWrapped`` protocol; a plain client is refused by name."""

from __future__ import annotations

import typing

import pytest
from openai import AsyncOpenAI, OpenAI

from leyline_agent import LeylineError, LeylineState, LeylineWrapped, leyline_state, wrap_openai


def test_accessor_and_protocol() -> None:
    plain = OpenAI(base_url="http://127.0.0.1:9/v1", api_key="-")
    wrapped = wrap_openai(plain, runtime="off", session_id="s1")
    state = leyline_state(wrapped)
    assert isinstance(state, LeylineState) and state is wrapped.leyline
    assert state.default_session == "s1" and state.session().session_id == "s1"
    assert isinstance(wrapped, LeylineWrapped) and not isinstance(plain, LeylineWrapped)
    assert leyline_state(wrapped.with_options(timeout=5)) is state  # copies share it
    with pytest.raises(LeylineError, match="OpenAI was not made by wrap_openai"):
        leyline_state(plain)
    aw = wrap_openai(AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="-"), runtime="off")
    assert isinstance(leyline_state(aw), LeylineState)


def test_annotations_name_the_state_type() -> None:
    import leyline_agent.agent.wrappers as w

    assert typing.get_type_hints(leyline_state)["return"] is LeylineState
    assert typing.get_type_hints(w.LeylineWrapped.leyline.fget)["return"] is LeylineState
