"""Model factory, tokenizer/chat template, and the runtime's CLI verbs."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig, AutoTokenizer

from leyline_agent.cli import build_parser
from leyline_agent.engine.checkpoints.modelgen import model_config
from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.errors import LeylineError


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


def test_chat_template_roles_tools_and_tool_calls(tok):
    tools = [{"type": "function", "function": {"name": "view", "parameters": {"type": "object"}}}]
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "thinking", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "view", "arguments": '{"path": "a.py"}'}}]},
        {"role": "tool", "tool_call_id": "1", "content": "print(1)"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "eval", "arguments": {"x": 1}}}]},
    ]  # fmt: skip
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nsys\n\n# Tools")
    assert json.dumps(tools[0]) in text
    assert (
        'thinking\n<tool_call>\n{"name": "view", "arguments": {"path": "a.py"}}\n</tool_call><|im_end|>'
        in text
    )
    assert "<|im_start|>tool\nprint(1)<|im_end|>\n" in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "eval", "arguments": {"x": 1}}\n</tool_call>'
        in text
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert text.count("<|im_start|>") == 6  # one per message (system merged with tools) + prompt
    plain = tok.apply_chat_template(msgs[1:2], tokenize=False, add_generation_prompt=False)
    assert plain == "<|im_start|>user\nu<|im_end|>\n"


def test_special_tokens_are_single_ids(tok):
    for t in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"):
        assert len(tok.encode(t, add_special_tokens=False)) == 1
    assert tok.eos_token == "<|im_end|>"
    text = "def f(x):\n    return x  # é\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert 4000 <= len(tok) <= 8500


def test_tiny_checkpoints_have_the_promised_shapes():
    for arch, mt in [
        ("deepseek_v2", "deepseek_v2"),
        ("deepseek_v3", "deepseek_v3"),
        ("llama", "llama"),
        ("qwen3", "qwen3"),
    ]:
        cfg = AutoConfig.from_pretrained(tiny_model_dir(arch))
        assert cfg.model_type == mt and cfg.num_hidden_layers <= 4


def test_mini_is_v2_lite_shaped():
    cfg = model_config("deepseek_v2", "mini", 6000, {"eos": 2, "pad": 0})
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim) == (
        512,
        64,
        128,
        128,
    )
    assert cfg.q_lora_rank is None and cfg.n_routed_experts > 1 and cfg.num_hidden_layers < 27
    with pytest.raises(LeylineError, match="--arch"):
        model_config("gpt2", "tiny", 10, {"eos": 2, "pad": 0})


def test_cli_verbs_parse():
    p = build_parser()
    a = p.parse_args(["make-model", "--arch", "qwen3", "--size", "tiny", "--out", "/tmp/x"])
    assert (a.arch, a.size, a.seed) == ("qwen3", "tiny", 0)
    s = p.parse_args(["serve", "--model", "/m"])
    assert (s.host, s.port, s.dtype, s.engine, s.no_prefix_cache) == (
        "127.0.0.1",
        30000,
        "float32",
        "embedded",
        False,
    )
    s = p.parse_args(
        [
            "serve",
            "--model",
            "/m",
            "--cache-tokens",
            "99",
            "--no-prefix-cache",
            "--engine",
            "sglang",
        ]
    )
    assert (s.cache_tokens, s.no_prefix_cache, s.engine) == (99, True, "sglang")
    with pytest.raises(SystemExit):
        p.parse_args(["make-model", "--arch", "gpt2", "--out", "/tmp/x"])
