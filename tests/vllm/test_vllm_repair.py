"""REPAIR on a model whose layers the plugin's row forward does not know (the tiny qwen3:
``Qwen3DecoderLayer``, with its q/k norms): refused by name (503 naming ``model_type``),
counted, before anything is held or written; the cached rows are untouched and an AMORTIZE
of the same span still runs. (REPAIR's values on llama: ``tests/conformance/test_repair.py``.)
"""

from __future__ import annotations


def test_repair_on_an_unknown_architecture_is_a_503_naming_it(qwen3):
    t = qwen3.ids(71, 80)
    cached, before = qwen3.complete(t + [7], "repair-qwen3")
    errors = qwen3.stats()["directive_errors"]
    d = {"start": 10, "end": 20, "replacement": [5, 6], "mode": "repair"}
    r = qwen3.directive({"tokens": t, "directives": [d]}, "repair-qwen3")
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["field"] == "model_type" and "repair" in err["message"].lower(), err
    assert qwen3.stats()["directive_errors"] == errors + 1
    again, after = qwen3.complete(t + [7], "repair-qwen3")
    assert again == len(t) and after == before  # nothing written, every row still cached
    ok = qwen3.directive({"tokens": t, "directives": [{**d, "mode": "amortize"}]}, "repair-qwen3")
    assert ok.status_code == 200, ok.text
