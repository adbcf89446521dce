"""Pacing of a splice's prefill (``stepper.Pace``, ``scheduler.schedule``), without timing.

The share a paced sequence gets is decided from step lengths handed in by the test, and the
steps run on a recording runner (no model): what is checked is which share each decision
gives, against values worked out by hand from the rules in ``stepper.py``'s docs.
"""

from __future__ import annotations

import pytest

from leyline_agent.engine import stepper as stepper_mod
from leyline_agent.engine.cache.allocator import SlotAllocator
from leyline_agent.engine.cache.radix import Match
from leyline_agent.engine.params import SamplingParams
from leyline_agent.engine.scheduler import schedule
from leyline_agent.engine.sequence import Sequence
from leyline_agent.engine.stepper import PACED_SIZES, Pace, Stepper
from leyline_agent.namespaces import ANONYMOUS


def test_the_reference_decode_step_is_a_median_one_stall_does_not_move_it():
    pace = Pace()
    for _ in range(14):
        pace.observe(0.003, decodes=1, paced=0, other_prefill=0)
    pace.observe(0.100, decodes=1, paced=0, other_prefill=0)  # one step stalled by the machine
    assert pace.decode_s == pytest.approx(0.003)  # a mean would say (14 * 3 + 100) / 15 = 9.5 ms


@pytest.mark.parametrize(
    ("step_s", "move"),
    [(0.0040, +1), (0.0051, 0), (0.0059, -1), (0.0010, +1), (0.0100, -1)],
)
def test_the_share_moves_one_size_by_the_step_it_made(step_s, move):
    # decode step 3 ms: below 1.5 x 3 = 4.5 ms the share grows, above 1.9 x 3 = 5.7 ms it shrinks
    pace = Pace()
    for _ in range(5):
        pace.observe(0.003, decodes=1, paced=0, other_prefill=0)
    before = pace.size
    pace.observe(step_s, decodes=1, paced=PACED_SIZES[before], other_prefill=0)
    assert pace.size == before + move


def test_a_size_known_to_be_too_long_is_only_tried_again_now_and_then():
    # decode step 3 ms; the share at one size makes a 4 ms step (extra 0.33, below the
    # band), at the next an 8 ms one (extra 1.67, above it): a share that moved by the last
    # step alone would alternate, half the steps at 8 ms, the median gap 2.7x a solo one
    pace = Pace()
    for _ in range(5):
        pace.observe(0.003, decodes=1, paced=0, other_prefill=0)
    low = pace.size
    sizes = []
    for _ in range(128):
        sizes.append(pace.size)
        step_s = 0.004 if pace.size <= low else 0.008
        pace.observe(step_s, decodes=1, paced=PACED_SIZES[pace.size], other_prefill=0)
    long = sum(size > low for size in sizes)
    assert set(sizes) == {low, low + 1}
    assert long <= 128 // stepper_mod.PROBE_STEPS + 2, sizes


def test_steps_that_say_nothing_about_the_share_leave_it():
    pace = Pace()
    for _ in range(5):
        pace.observe(0.003, decodes=1, paced=0, other_prefill=0)
    before = pace.size
    pace.observe(0.5, decodes=1, paced=4, other_prefill=30)  # another prompt's prefill ran too
    pace.observe(0.5, decodes=0, paced=512, other_prefill=0)  # the paced sequence alone
    assert pace.size == before


class _Runner:
    """Records each forward's rows per sequence; nobody here wants logits."""

    device = "cpu"

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def run(self, inputs):
        assert not any(i.want_logits for i in inputs)
        self.batches.append([len(i.token_ids) for i in inputs])
        return None


class _Host:
    tokenizer = None

    def __init__(self) -> None:
        self.runner = _Runner()
        self.allocator = SlotAllocator(100_000)


def _seq(n: int, paced: bool) -> Sequence:
    """A prefill of ``n`` tokens nobody samples from (max_tokens 0)."""
    return Sequence(
        prompt_ids=list(range(3, 3 + n)), params=SamplingParams(max_tokens=0), namespace=ANONYMOUS,
        match=Match(0, [], None), sampler=None, detok=None, stop_ids=frozenset(), t0=0.0,
        paced=paced,
    )  # fmt: skip


def test_a_paced_prefill_stays_paced_between_two_requests_of_another_session(monkeypatch):
    host = _Host()
    st = Stepper(host, step_tokens=512)
    share = st.pace.tokens(512)
    splice, other = _seq(2000, paced=True), _seq(3, paced=False)
    st.running += [splice, other]
    st.step()  # the other session's prompt (3 tokens) beside the paced share
    assert host.runner.batches[-1] == [share, 3]
    assert other not in st.running  # done: the other session is between two requests
    st.step()  # alone, but within PACE_HOLD_S of the shared step: still the share
    assert host.runner.batches[-1] == [share]
    monkeypatch.setattr(stepper_mod, "PACE_HOLD_S", 0.0)  # the hold has passed
    st.step()
    assert host.runner.batches[-1] == [512]  # a lone splice takes the whole budget


def test_schedule_applies_a_paced_share_it_is_given_even_with_no_decode():
    splice = _seq(2000, paced=True)
    assert [p.num_tokens for p in schedule([splice], 512, paced_tokens=4)] == [4]
    assert [p.num_tokens for p in schedule([splice], 512, paced_tokens=None)] == [512]
