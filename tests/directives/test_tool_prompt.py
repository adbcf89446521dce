"""``directives/tool_prompt.py`` on real templates: SmolLM2's ChatML (no tool block) gets the
tools and calls in the Hermes form, a call renders back exactly as the forced-call grammar
writes it, and a template with its own tool block (the toy tokenizer's) is left alone."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from leyline_agent.directives.compile import render
from leyline_agent.directives.tool_prompt import call_text, prepare, set_setting, template_tools
from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.errors import RequestError
from leyline_agent.server.tool_choice import ToolChoice

TOOLS = [{"type": "function", "function": {"name": "ls", "description": "List files",
                                           "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
CALL = {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": '{"a":1}'}}
LOOP = [{"role": "user", "content": "List the files."},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"}]  # fmt: skip


@pytest.fixture(scope="module")
def smol():
    from leyline_agent.engine.checkpoints.fetch import smollm2_dir

    return AutoTokenizer.from_pretrained(smollm2_dir())


def test_chatml_without_tools_gets_the_hermes_form(smol):
    assert template_tools(smol) == template_tools(smol)  # probed once, remembered
    assert not template_tools(smol).tools and not template_tools(smol).calls
    text = smol.decode(render(smol, LOOP, TOOLS, True))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n") and "<tools>" in system
    assert json.dumps(TOOLS[0]) in system  # each tool as one JSON line
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "ls", "arguments": {"a":1}}\n</tool_call><|im_end|>' in text
    response = {"tool_call_id": "call_1", "name": "ls", "content": "a.py\nb.py"}
    assert f"<|im_start|>tool\n<tool_response>\n{json.dumps(response)}\n</tool_response>" in text
    # without tools the prompt is the template's own (its default system prompt kept)
    bare = smol.decode(render(smol, LOOP[:1], None, True))
    assert bare == smol.apply_chat_template(LOOP[:1], tokenize=False, add_generation_prompt=True)


def test_a_system_message_gets_the_tools_appended(smol):
    messages = [{"role": "system", "content": "Be brief."}, *LOOP[:1]]
    out, tools = prepare(smol, messages, TOOLS)
    assert tools is None and out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert messages[0]["content"] == "Be brief."  # the caller's list is not changed


def test_a_call_renders_as_the_forced_call_grammar_writes_it():
    """``forced_prefix`` + what the grammar makes the model write = ``call_text``."""
    forced = ToolChoice("function", "ls").forced_prefix()
    written = forced + '{"a":1}' + "}\n</tool_call>"  # arguments, then the grammar's close
    assert call_text("ls", '{"a":1}') == written
    assert call_text("ls", "not json") == '<tool_call>\n{"name": "ls", "arguments": "not json"}\n</tool_call>'


def test_a_template_with_a_tool_block_is_left_alone():
    tok = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    assert template_tools(tok).tools and template_tools(tok).calls
    out, tools = prepare(tok, LOOP, TOOLS)
    assert out is LOOP and tools is TOOLS


def test_the_template_setting_refuses_what_the_template_cannot_render(smol):
    set_setting(smol, "template")
    try:
        with pytest.raises(RequestError) as e:
            render(smol, LOOP[:1], TOOLS, True)
        assert e.value.field == "tools"
        with pytest.raises(RequestError) as e:
            render(smol, LOOP, None, True, where="new_messages")
        assert e.value.field == "new_messages[1]"
    finally:
        set_setting(smol, "hermes")
