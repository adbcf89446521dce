"""Bad input to rotate_band: a clear error naming the argument, the buffer bitwise unchanged."""

from __future__ import annotations

import pytest
import torch

from leyline_agent.kernels import RopeSpec, rotate_band

SPEC = RopeSpec(inv_freq=(1.0, 0.25, 0.0625, 0.015625), rotary_dim=8, layout="interleaved")
ROWS, WIDTH = 10, 24


def _buffer() -> torch.Tensor:
    return torch.randn(2, ROWS, WIDTH, generator=torch.Generator().manual_seed(0))


OK = dict(src=torch.tensor([0, 1, 2]), dst=torch.tensor([5, 6, 7]), delta=4, band_offset=8)

BAD_ARGS = [
    # (id, overrides, exception, words the message must contain)
    ("src_float", dict(src=torch.tensor([0.0, 1.0, 2.0])), TypeError, "src"),
    ("src_bool", dict(src=torch.tensor([True, False, True])), TypeError, "src"),
    ("src_2d", dict(src=torch.tensor([[0, 1, 2]])), ValueError, "src"),
    ("src_list_of_floats", dict(src=[0, 1.5, 2]), TypeError, "src"),
    ("src_string", dict(src="012"), TypeError, "src"),
    ("src_out_of_range", dict(src=torch.tensor([0, ROWS, 2])), ValueError, "src[1]"),
    ("src_negative", dict(src=torch.tensor([0, 1, -1])), ValueError, "src[2]"),
    (
        "src_other_device",
        dict(src=torch.tensor([0, 1, 2], device="meta")),
        ValueError,
        "src.device",
    ),
    ("dst_out_of_range", dict(dst=torch.tensor([5, 6, 99])), ValueError, "dst[2]"),
    ("dst_duplicates", dict(dst=torch.tensor([5, 6, 5])), ValueError, "dst"),
    ("length_mismatch", dict(dst=torch.tensor([5, 6])), ValueError, "src has 3 rows but dst has 2"),
    ("delta_float", dict(delta=1.5), TypeError, "delta"),
    ("delta_bool", dict(delta=True), TypeError, "delta"),
    ("delta_float_tensor", dict(delta=torch.tensor([1.0, 2.0, 3.0])), TypeError, "delta"),
    ("delta_wrong_shape", dict(delta=torch.tensor([1, 2])), ValueError, "delta"),
    ("delta_too_large", dict(delta=2**40), ValueError, "delta"),
    ("delta_other_device", dict(delta=torch.tensor(3, device="meta")), ValueError, "delta.device"),
    ("band_offset_float", dict(band_offset=8.0), TypeError, "band_offset"),
    ("band_offset_negative", dict(band_offset=-1), ValueError, "band_offset"),
    ("band_outside_row", dict(band_offset=WIDTH - 4), ValueError, "band_offset"),
]


@pytest.mark.parametrize("backend", ["torch", "triton", "c"])
@pytest.mark.parametrize("name,overrides,exc,words", BAD_ARGS, ids=[b[0] for b in BAD_ARGS])
def test_bad_argument_leaves_buffer_unchanged(name, overrides, exc, words, backend):
    buf = _buffer()
    before = buf.clone()
    args = {**OK, **overrides}
    with pytest.raises(exc) as err:
        rotate_band(
            buf, args["src"], args["dst"], args["delta"], SPEC, args["band_offset"], backend=backend
        )
    assert words in str(err.value)
    assert torch.equal(buf.view(torch.int32), before.view(torch.int32))


def test_good_arguments_do_mutate():
    """Sanity for the table above: the same call without the bad override changes the buffer."""
    buf = _buffer()
    before = buf.clone()
    rotate_band(buf, OK["src"], OK["dst"], OK["delta"], SPEC, OK["band_offset"])
    assert not torch.equal(buf, before)


@pytest.mark.parametrize(
    "make,exc,words",
    [
        (lambda: [[1.0] * WIDTH] * ROWS, TypeError, "buffer must be a torch.Tensor"),
        (lambda: torch.zeros(ROWS, WIDTH, dtype=torch.int32), TypeError, "buffer.dtype"),
        (lambda: torch.zeros(ROWS, WIDTH, dtype=torch.float64), TypeError, "buffer.dtype"),
        (lambda: torch.zeros(WIDTH), ValueError, "buffer must have shape"),
        (lambda: torch.zeros(WIDTH, ROWS).t(), ValueError, "last dim must be contiguous"),
        (lambda: torch.zeros(1, WIDTH).expand(ROWS, WIDTH), ValueError, "overlap"),
    ],
    ids=["not_tensor", "int", "float64", "1d", "last_dim_strided", "expanded"],
)
def test_bad_buffer(make, exc, words):
    buf = make()
    before = buf.clone() if isinstance(buf, torch.Tensor) else None
    with pytest.raises(exc, match=words):
        rotate_band(buf, [0], [1], 1, SPEC)
    if before is not None:
        assert torch.equal(buf, before)


def test_bad_spec_and_backend(monkeypatch):
    buf = _buffer()
    before = buf.clone()
    with pytest.raises(TypeError, match="spec must be a RopeSpec"):
        rotate_band(buf, [0], [1], 1, {"inv_freq": (1.0,), "layout": "half"})
    with pytest.raises(ValueError, match="backend='cuda'"):
        rotate_band(buf, [0], [1], 1, SPEC, backend="cuda")
    monkeypatch.setenv("LEYLINE_KERNEL", "fast")
    with pytest.raises(ValueError, match=r"\$LEYLINE_KERNEL='fast'"):
        rotate_band(buf, [0], [1], 1, SPEC)
    assert torch.equal(buf, before)


def test_plan_reuse_across_layers_and_mismatch_errors():
    from leyline_agent.kernels import apply_plan, plan_rotation

    layers = [_buffer() for _ in range(3)]
    expected = [b.clone() for b in layers]
    plan = plan_rotation(layers[0], OK["src"], OK["dst"], OK["delta"], SPEC, OK["band_offset"])
    for buf, exp in zip(layers, expected, strict=True):
        apply_plan(buf, plan, SPEC)
        rotate_band(exp, OK["src"], OK["dst"], OK["delta"], SPEC, OK["band_offset"])
        assert torch.equal(buf, exp)

    short = torch.randn(2, 6, WIDTH)  # plan reaches row 7
    narrow = torch.randn(2, ROWS, 12)  # band ends at 16
    other = RopeSpec(inv_freq=(1.0, 0.5), rotary_dim=4, layout="half")
    for buf, spec, words in [
        (short, SPEC, "plan reaches row 7"),
        (narrow, SPEC, "band ends at 16"),
        (_buffer(), other, "spec must be the RopeSpec"),
    ]:
        before = buf.clone()
        with pytest.raises(ValueError, match=words):
            apply_plan(buf, plan, spec)
        assert torch.equal(buf, before)
