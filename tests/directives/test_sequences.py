"""``directives.sequences.SequenceIndex`` (vLLM's): which cached full block holds
the rows of a prefix that ends inside it, checked on made-up sequences (block size 4)."""

from __future__ import annotations

from leyline_agent.directives.sequences import SequenceIndex

BS = 4


def _hashes(tokens: list[int], salt: str | None = None) -> list[tuple]:
    """Chained block hashes, as vLLM's: each over its parent and its block's tokens."""
    out, parent = [], salt
    for j in range(len(tokens) // BS):
        parent = (parent, tuple(tokens[j * BS : (j + 1) * BS]))
        out.append(parent)
    return out


def test_a_prefix_ending_inside_a_full_block_is_continued_by_that_block():
    seq = list(range(10, 23))  # 13 tokens: 3 full blocks and one row
    idx = SequenceIndex()
    idx.record("ns", None, seq, _hashes(seq))
    base = seq[:10]  # 2 full blocks and 2 rows of the third
    ext = idx.extension("ns", None, base, _hashes(base), BS)
    assert ext is not None and ext.block_hash == _hashes(seq)[2] and ext.num_rows == 2
    # rows agree only as far as the tokens do
    other = [*seq[:9], 99]
    assert idx.extension("ns", None, other, _hashes(other), BS).num_rows == 1


def test_no_extension_across_namespaces_salts_or_other_prefixes():
    seq = list(range(10, 23))
    idx = SequenceIndex()
    idx.record("ns", "salt", seq, _hashes(seq, "salt"))
    base = seq[:10]
    assert idx.extension("other", "salt", base, _hashes(base, "salt"), BS) is None
    assert idx.extension("ns", None, base, _hashes(base), BS) is None  # another salt
    changed = [7, *seq[1:10]]  # the first block differs: another prefix
    assert idx.extension("ns", "salt", changed, _hashes(changed, "salt"), BS) is None
    assert idx.extension("ns", "salt", seq[:8], _hashes(seq[:8], "salt"), BS) is None  # none past


def test_bounded_by_the_tokens_it_keeps():
    idx = SequenceIndex(per_namespace=2, max_tokens=30)
    for k in range(4):
        seq = [k * 100 + i for i in range(13)]
        idx.record(f"ns{k}", None, seq, _hashes(seq))
    assert idx._tokens <= 30  # noqa: SLF001 - the bound itself
    seq = [300 + i for i in range(13)]
    assert idx.extension("ns3", None, seq[:10], _hashes(seq[:10]), BS) is not None  # newest kept
    first = list(range(13))
    assert idx.extension("ns0", None, first[:10], _hashes(first[:10]), BS) is None  # oldest went
