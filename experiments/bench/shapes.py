"""Model shapes for the device benchmarks: the ``mini`` checkpoints and two real models' shapes.

    engine_for(shape, device, dtype, budget)

- ``mini-<arch>`` (``mini-llama``, ``mini-deepseek_v2``): the seeded ``mini`` checkpoint
  (``checkpoints/store.model_dir``), loaded from its folder.
- ``llama-1b``: Llama-3.2-1B's shape (16 layers, 2,048 wide, 32 q / 8 kv heads of 128,
  MLP 8,192, vocabulary 128,256, rope theta 500,000), random weights.
- ``dsv2-lite``: DeepSeek-V2-Lite's MLA shape (2,048 wide, 16 heads, kv_lora_rank 512,
  rope 64, nope 128, v 128, 64 routed experts of 1,408 with 6 per token and 2 shared, dense
  first layer of 10,944, vocabulary 102,400) with 4 layers, random weights.

The random-weight shapes are built directly on the device (``from_config`` under
``torch.device``: seconds, no checkpoint on disk) with the project's toy tokenizer beside
them; token ids above the tokenizer's vocabulary decode to nothing. ``small=True`` shrinks a
shape for a CPU dry run (one layer, 256 wide, the same heads, head sizes and vocabulary).
"""

from __future__ import annotations

from typing import Any

__all__ = ["SHAPES", "engine_for"]

_LLAMA_1B: dict[str, Any] = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, initializer_range=0.02,
)  # fmt: skip
_DSV2_LITE: dict[str, Any] = dict(
    hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=4,
    num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=64,
    num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1, vocab_size=102400,
    max_position_embeddings=163840, initializer_range=0.02,
)  # fmt: skip
_SMALL: dict[str, Any] = dict(
    hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=1,
    n_routed_experts=8,
)  # fmt: skip
SHAPES = ("mini-llama", "mini-deepseek_v2", "llama-1b", "dsv2-lite")


def engine_for(shape: str, device: str, dtype: str, budget: int, small: bool = False) -> Any:
    """An ``Engine`` of ``shape`` on ``device`` with room for ``budget`` cached tokens."""
    from leyline_agent.engine.engine import Engine

    if shape not in SHAPES:
        raise SystemExit(f"--shape: {shape!r} is not one of {', '.join(SHAPES)}")
    if shape.startswith("mini-"):
        from leyline_agent.engine.checkpoints.store import model_dir

        return Engine.from_pretrained(
            model_dir(shape[5:], "mini", 0), dtype=dtype, device=device,
            cache_budget_tokens=budget,
        )  # fmt: skip
    model, tok = _random_model(shape, device, dtype, small)
    return Engine(model, tok, model_name=shape, cache_budget_tokens=budget)


def _random_model(shape: str, device: str, dtype: str, small: bool) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from leyline_agent.engine.checkpoints.modelgen import model_config
    from leyline_agent.engine.checkpoints.store import model_dir
    from leyline_agent.engine.checkpoints.toy_tokenizer import EOS, IM_END
    from leyline_agent.engine.model.loader import resolve_device, resolve_dtype

    tok = AutoTokenizer.from_pretrained(model_dir("llama", "tiny", 0))  # tokenizer + template
    special = {"eos": tok.convert_tokens_to_ids(IM_END), "pad": tok.convert_tokens_to_ids(EOS)}
    arch, knobs = ("llama", _LLAMA_1B) if shape == "llama-1b" else ("deepseek_v2", _DSV2_LITE)
    base = model_config(arch, "mini", len(tok), special)
    over = {**knobs, **({k: v for k, v in _SMALL.items() if k in knobs} if small else {})}
    config = type(base).from_dict({**base.to_dict(), **over})
    config._attn_implementation = "sdpa"
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    torch.manual_seed(0)
    with dev:
        model = AutoModelForCausalLM.from_config(config, dtype=dt)
    model.generation_config.eos_token_id = special["eos"]
    model.generation_config.pad_token_id = special["pad"]
    return model.eval(), tok
