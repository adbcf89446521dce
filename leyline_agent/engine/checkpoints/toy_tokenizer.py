"""A small byte-level BPE tokenizer trained locally, with a tool-calling chat template.

Nothing is downloaded: the training text is the Python standard library's sources plus
debug-gym's mini_nightmare tasks when installed (the kind of text an agent's context holds).
The chat template is ChatML with Hermes/Qwen-style tool calls:

    <|im_start|>system\\n...# Tools ... <tools>{json}</tools>...<|im_end|>\\n
    <|im_start|>assistant\\ntext<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call><|im_end|>\\n
    <|im_start|>tool\\n{result}<|im_end|>\\n

Every message starts with ``<|im_start|>`` (a special token), so token sequences split
into messages at that id; ``directives.compile`` relies on it.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

from leyline_agent.families import CHATML_HERMES

__all__ = ["CHAT_TEMPLATE", "EOS", "IM_START", "IM_END", "train_tokenizer", "training_text_key"]

# The ChatML + Hermes row of ``leyline_agent.families``: the template below spells it out.
IM_START = CHATML_HERMES.message_boundary
IM_END, EOS = CHATML_HERMES.stop_tokens
TOOL_OPEN, TOOL_CLOSE = CHATML_HERMES.tool_call_open, CHATML_HERMES.tool_call_close
SPECIAL = [EOS, IM_START, IM_END]
ADDED = [TOOL_OPEN, TOOL_CLOSE]

CHAT_TEMPLATE = (
    "{% macro args_json(a) %}{% if a is string %}{{ a }}{% else %}{{ a | tojson }}"
    "{% endif %}{% endmacro %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages and messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{{ message['content'] or '' }}"
    "{% for tc in message.get('tool_calls') or [] %}"
    "{% set f = tc['function'] if tc.get('function') else tc %}"
    "{% if loop.first and not message['content'] %}{% else %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ f[\'name\'] }}", "arguments": {{ args_json(f[\'arguments\']) }}}\n</tool_call>'
    "{% endfor %}"
    "<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _training_files(max_bytes: int) -> list[Path]:
    """Local text, deterministic order, capped at ``max_bytes``."""
    roots: list[Path] = []
    try:  # debug-gym's tasks, when installed
        import debug_gym

        site = Path(debug_gym.__file__).resolve().parent.parent
        roots.append(site / "data" / "mini_nightmare")
    except ImportError:
        pass
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    roots += [stdlib / d for d in ("json", "asyncio", "email", "unittest", "logging", "http")]
    roots.append(stdlib)
    files: list[Path] = []
    seen: set[Path] = set()
    total = 0
    for root in roots:
        if not root.is_dir():
            continue
        pattern = "*.py" if root == stdlib else "**/*.py"
        for f in sorted(root.glob(pattern)):
            if f in seen or not f.is_file():
                continue
            seen.add(f)
            files.append(f)
            total += f.stat().st_size
            if total >= max_bytes:
                return files
    return files


def training_text_key(max_bytes: int = 2_000_000) -> str:
    """What ``train_tokenizer`` would read, as a digest of its files' names (from the
    folder that holds them) and sizes: two environments whose texts differ (debug-gym
    installed or not, another stdlib) train different tokenizers."""
    import hashlib

    h = hashlib.sha256()
    for f in _training_files(max_bytes):
        h.update(f"{f.parent.name}/{f.name}:{f.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


def _lines(files: list[Path]) -> Iterator[str]:
    for f in files:
        yield f.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(vocab_size: int = 6000, max_bytes: int = 2_000_000):
    """Train a byte-level BPE and wrap it as a ``PreTrainedTokenizerFast`` with the template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_lines(_training_files(max_bytes)), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=EOS,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[IM_START, EOS],
    )
    fast.add_tokens(ADDED)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 32768
    return fast
