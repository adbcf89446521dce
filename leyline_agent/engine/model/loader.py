"""Load a local Hugging Face checkpoint (model + tokenizer) for the embedded engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from leyline_agent.errors import LeylineError, RuntimeUnavailableError
from leyline_agent.families import embedded_model_types

__all__ = ["Loaded", "SUPPORTED", "load", "resolve_device", "resolve_dtype"]

SUPPORTED = embedded_model_types()  # the families the embedded engine serves


@dataclass(slots=True)
class Loaded:
    model: Any
    tokenizer: Any
    config: Any
    device: torch.device
    dtype: torch.dtype
    name: str


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeUnavailableError(f"device: {device!r} requested but CUDA is not available")
    if device != "cpu" and not device.startswith("cuda"):
        raise LeylineError(f"device: {device!r} is not one of cpu, cuda, auto")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
    }
    if dtype not in table:
        raise LeylineError(f"dtype: {dtype!r} is not one of float32, bfloat16")
    return table[dtype]


def load(path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu") -> Loaded:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    if not (p / "config.json").is_file():
        raise LeylineError(f"model: {str(path)!r} is not a model directory (no config.json)")
    config = AutoConfig.from_pretrained(p)
    if config.model_type not in SUPPORTED:
        raise LeylineError(
            f"model: model_type {config.model_type!r} is not supported by the embedded engine "
            f"(supported: {', '.join(SUPPORTED)})"
        )
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    model = AutoModelForCausalLM.from_pretrained(p, dtype=dt, attn_implementation="sdpa")
    model.to(dev).eval()
    tokenizer = AutoTokenizer.from_pretrained(p)
    return Loaded(model, tokenizer, model.config, dev, dt, p.resolve().name)
