"""``leyline make-model``: seeded random-weight Hugging Face checkpoints for tests and demos.

``tiny`` models are a few small layers (fast tests); ``mini`` is DeepSeek-V2-Lite's shape
scaled down (kv_lora_rank 512, rope dim 64, fewer and narrower layers) so that CPU timings
of a splice against a re-prefill mean something. Weights are random (seeded); the
tokenizer is trained locally (see ``tokenizer.py``) and saved next to the weights.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from leyline_agent.errors import LeylineError

__all__ = ["ARCHS", "SIZES", "make_model", "model_config"]

ARCHS = ("deepseek_v2", "deepseek_v3", "llama", "qwen3")
SIZES = ("tiny", "mini")

# (tiny, mini) of each knob. initializer_range is larger than a real model's so that random
# logits have a real spread (greedy argmax is not decided by 1e-6 noise in tests).
_EVERY: dict[str, tuple[Any, Any]] = {
    "hidden_size": (128, 1024),
    "intermediate_size": (256, 2816),
    "num_hidden_layers": (2, 4),
    "initializer_range": (0.08, 0.04),
}
_MLA: dict[str, tuple[Any, Any]] = {
    "moe_intermediate_size": (64, 512),
    "num_attention_heads": (4, 8),
    "num_key_value_heads": (4, 8),
    "kv_lora_rank": (32, 512),
    "q_lora_rank": (None, None),
    "qk_rope_head_dim": (16, 64),
    "qk_nope_head_dim": (16, 128),
    "v_head_dim": (16, 128),
    "n_routed_experts": (4, 8),
    "num_experts_per_tok": (2, 2),
    "n_shared_experts": (1, 1),
    "first_k_dense_replace": (1, 1),
}
_GQA: dict[str, tuple[Any, Any]] = {
    "num_attention_heads": (4, 16),
    "num_key_value_heads": (2, 4),
    "head_dim": (32, 64),
}


def _shape(
    knobs: dict[str, tuple[Any, Any]], size: str, layers: int | None = None
) -> dict[str, Any]:
    k = SIZES.index(size)
    out = {name: values[k] for name, values in {**_EVERY, **knobs}.items()}
    if layers is not None:
        out["num_hidden_layers"] = layers
    return out


def model_config(
    arch: str, size: str, vocab_size: int, special: dict[str, int], layers: int | None = None
) -> Any:
    """The transformers config of one (arch, size); ``layers`` overrides the layer count."""
    import transformers as tf

    if arch not in ARCHS:
        raise LeylineError(f"--arch: {arch!r} is not one of {', '.join(ARCHS)}")
    if size not in SIZES:
        raise LeylineError(f"--size: {size!r} is not one of {', '.join(SIZES)}")
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        eos_token_id=special["eos"],
        pad_token_id=special["pad"],
        bos_token_id=None,
        rms_norm_eps=1e-6,
    )
    if arch.startswith("deepseek"):
        shape = _shape(_MLA, size, layers)
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if arch == "deepseek_v2":
            return tf.DeepseekV2Config(
                **common, **shape, rope_parameters=rope, topk_method="greedy"
            )
        if size == "tiny":
            shape["q_lora_rank"] = 48  # exercise the q-LoRA path on V3
        return tf.DeepseekV3Config(
            **common, **shape, rope_parameters=rope, rope_interleave=True, n_group=1, topk_group=1
        )
    shape = _shape(_GQA, size, layers)
    rope = {"rope_type": "default", "rope_theta": 10000.0 if arch == "llama" else 1000000.0}
    if arch == "llama":
        return tf.LlamaConfig(**common, **shape, rope_parameters=rope)
    return tf.Qwen3Config(**common, **shape, rope_parameters=rope)


def make_model(
    arch: str,
    size: str,
    out: str | Path,
    seed: int = 0,
    tokenizer: Any = None,
    *,
    template: str = "chatml",
    layers: int | None = None,
) -> Path:
    """Write a checkpoint (config, safetensors, tokenizer with chat template) to ``out``.

    The directory is built in a temporary sibling and renamed into place, so a reader never
    sees half a model. ``tokenizer``: reuse an already trained one (tests build several).
    ``template``: a name of ``templates.TEMPLATES`` (``reasoning``: Qwen3-style thinking,
    ``dated``: a date line at the head). ``layers``: override the size's layer count.
    """
    from leyline_agent.engine.checkpoints.templates import TEMPLATES

    if template not in TEMPLATES:
        raise LeylineError(f"--template: {template!r} is not one of {', '.join(TEMPLATES)}")
    if layers is not None and layers < 1:
        raise LeylineError(f"--layers: {layers} must be >= 1")
    import torch
    from transformers import AutoModelForCausalLM

    from leyline_agent.engine.checkpoints.toy_tokenizer import EOS, IM_END, train_tokenizer

    out = Path(out)
    tok = tokenizer if tokenizer is not None else train_tokenizer()
    special = {"eos": tok.convert_tokens_to_ids(IM_END), "pad": tok.convert_tokens_to_ids(EOS)}
    config = model_config(arch, size, len(tok), special, layers)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = special["eos"]
    model.generation_config.pad_token_id = special["pad"]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok.chat_template = TEMPLATES[template]
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
