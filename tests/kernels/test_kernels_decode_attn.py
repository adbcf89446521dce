"""kernels/decode_attn.c against an independent computation: float64 attention over each
sequence's rows gathered into one tensor (an explicit softmax on copies), for the shapes the
engine gives it (GQA heads, MLA's two key parts), fp32 and bf16 pools, rows in many runs, a
batch of sequences of different lengths, one and two threads (two: a long sequence split
into shares)."""

from __future__ import annotations

import pytest
import torch

from leyline_agent.kernels import decode_attn


def _truth(qs, k_pools, v_pool, runs, scale):
    """float64: per sequence, its rows copied out in run order, explicit softmax."""
    outs = []
    for s, r in enumerate(runs):
        rows = [i for f, n in r for i in range(f, f + n)]
        idx = torch.tensor(rows)
        scores = sum(
            q[s].double() @ k.index_select(1, idx).double().transpose(1, 2)
            for q, k in zip(qs, k_pools, strict=True)
        )
        w = torch.exp(scale * scores - (scale * scores).amax(-1, keepdim=True))
        w = w / w.sum(-1, keepdim=True)
        outs.append(w @ v_pool.index_select(1, idx).double())
    return torch.stack(outs)


def _runs(g: torch.Generator, slots: int, lengths: list[int], pieces: int):
    """Per sequence, ``pieces`` runs at random places of the pool (they may overlap between
    sequences: shared prefixes do)."""
    out = []
    for n in lengths:
        cuts = sorted(torch.randperm(n - 1, generator=g)[: pieces - 1].add(1).tolist())
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
        out.append([(int(torch.randint(0, slots - m, (1,), generator=g)), m) for m in sizes])
    return out


def test_the_kernel_builds_here():
    assert decode_attn.available(), decode_attn.build_error()


@pytest.mark.parametrize(
    ("heads", "group", "dim"), [(4, 4, 64), (2, 2, 32), (1, 3, 16), (2, 5, 48)]
)
@pytest.mark.parametrize("pieces", [1, 3, 17])
def test_gqa_shapes_equal_float64_attention(threads, heads, group, dim, pieces):
    g = torch.Generator().manual_seed(heads * 100 + group * 10 + pieces)
    slots = 3000
    k = torch.randn(heads, slots, dim, generator=g)
    v = torch.randn(heads, slots, dim, generator=g)
    lengths = [40, 1300, 700]
    runs = _runs(g, slots, lengths, pieces)
    q = torch.randn(len(lengths), heads, group, dim, generator=g)
    scale = dim**-0.5
    before = (k.clone(), v.clone())
    out = decode_attn.decode_attention([q], [k], v, runs, scale)
    truth = _truth([q], [k], v, runs, scale)
    assert out.shape == truth.shape
    assert (out.double() - truth).abs().max() <= 2e-5
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])  # the pool is only read


@pytest.mark.parametrize("lengths", [[513, 1, 5000], [5000]], ids=["batch", "one"])
def test_mla_two_key_parts_and_eight_heads_equal_float64_attention(threads, lengths):
    """``one``: a single sequence, which two threads take in two shares (merged by their
    maxima and sums)."""
    g = torch.Generator().manual_seed(7)
    slots, heads, rank, rope = 6000, 8, 512, 64
    c_kv = torch.randn(1, slots, rank, generator=g) * 0.5
    k_pe = torch.randn(1, slots, rope, generator=g) * 0.5
    runs = _runs(g, slots, lengths, 2)
    q_lat = torch.randn(len(lengths), 1, heads, rank, generator=g) * 0.1
    q_pe = torch.randn(len(lengths), 1, heads, rope, generator=g) * 0.1
    scale = 192**-0.5
    out = decode_attn.decode_attention([q_lat, q_pe], [c_kv, k_pe], c_kv, runs, scale)
    truth = _truth([q_lat, q_pe], [c_kv, k_pe], c_kv, runs, scale)
    assert (out.double() - truth).abs().max() <= 2e-5


def test_strided_queries_and_peaked_scores(threads):
    """Queries as a strided view (the engine's transposed projections) and scores far apart
    (the softmax is nearly one-hot: exp's clamp and the shares' merge)."""
    g = torch.Generator().manual_seed(11)
    k = torch.randn(2, 4000, 32, generator=g) * 4
    v = torch.randn(2, 4000, 32, generator=g)
    base = torch.randn(2, 3, 2, 32, generator=g) * 4  # [heads, seqs, group, d]
    q = base.transpose(0, 1)  # [seqs, heads, group, d], not contiguous
    runs = _runs(g, 4000, [3000, 2500, 9], 4)
    out = decode_attn.decode_attention([q], [k], v, runs, 1.0)
    truth = _truth([q], [k], v, runs, 1.0)
    assert (out.double() - truth).abs().max() <= 2e-5


def test_the_torch_reference_is_the_same_attention():
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(2, 500, 32, generator=g), torch.randn(2, 500, 32, generator=g)
    q = torch.randn(2, 2, 3, 32, generator=g)
    runs = [[(0, 100), (300, 50)], [(450, 50)]]
    ref = decode_attn.decode_attention_torch([q], [k], v, runs, 0.3)
    assert (ref.double() - _truth([q], [k], v, runs, 0.3)).abs().max() <= 1e-5


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda a: {**a, "runs": [[(0, 10)]] * 3}, "runs"),  # 3 sequences for 2 queries
        (lambda a: {**a, "runs": [[(95, 10)], [(0, 1)]]}, r"runs\[0\]"),  # past the pool
        (lambda a: {**a, "runs": [[], [(0, 1)]]}, r"runs\[0\]"),
        (lambda a: {**a, "v_pool": a["v_pool"][:1]}, "v_pool"),
        (lambda a: {**a, "k_pools": [a["k_pools"][0][:, :50]]}, r"k_pools\[0\]"),
        (lambda a: {**a, "qs": [a["qs"][0][..., :16]]}, r"k_pools\[0\]"),
        (lambda a: {**a, "qs": [a["qs"][0][0]]}, r"qs\[0\]"),
    ],
)
def test_bad_input_names_the_argument(change, field):
    g = torch.Generator().manual_seed(4)
    args = {
        "qs": [torch.randn(2, 2, 2, 32, generator=g)],
        "k_pools": [torch.randn(2, 100, 32, generator=g)],
        "v_pool": torch.randn(2, 100, 32, generator=g),
        "runs": [[(0, 10)], [(50, 20)]],
    }
    with pytest.raises(ValueError, match=field):
        decode_attn.decode_attention(**change(args), scale=1.0)


@pytest.mark.parametrize("arch", ["gqa", "mla"])
def test_bf16_pools_equal_float64_attention_over_the_same_rows(threads, arch):
    """A bf16 pool (and bf16 queries): the kernel widens each row to fp32 as it loads it; the
    truth is float64 attention over the same bf16 values."""
    g = torch.Generator().manual_seed(13)
    if arch == "gqa":
        k = torch.randn(4, 5000, 64, generator=g).bfloat16()
        v = torch.randn(4, 5000, 64, generator=g).bfloat16()
        qs, k_pools, scale = [torch.randn(3, 4, 4, 64, generator=g).bfloat16()], [k], 0.125
    else:
        c = (torch.randn(1, 5000, 512, generator=g) * 0.5).bfloat16()
        pe = (torch.randn(1, 5000, 64, generator=g) * 0.5).bfloat16()
        q_lat = (torch.randn(3, 1, 8, 512, generator=g) * 0.1).bfloat16()
        q_pe = (torch.randn(3, 1, 8, 64, generator=g) * 0.1).bfloat16()
        qs, k_pools, v, scale = [q_lat, q_pe], [c, pe], c, 192**-0.5
    runs = _runs(g, 5000, [700, 4000, 33], 3)
    out = decode_attn.decode_attention(qs, k_pools, v, runs, scale)
    truth = _truth(qs, k_pools, v, runs, scale)
    assert out.dtype == torch.float32
    assert (out.double() - truth).abs().max() <= 2e-5


def test_inputs_it_does_not_take_are_said_by_fits():
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 2, 2, 32, generator=g), torch.randn(2, 10, 32, generator=g)
    assert decode_attn.fits([q], [k], k)
    assert decode_attn.fits([q.bfloat16()], [k.bfloat16()], k.bfloat16())
    assert not decode_attn.fits([q.double()], [k.double()], k.double())
    assert not decode_attn.fits([q.half()], [k.half()], k.half())
    assert not decode_attn.fits([q], [k], k.bfloat16())  # keys and values of two dtypes
    assert not decode_attn.fits([q[..., :24]], [k[..., :24]], k[..., :24])  # width 24
