"""``paged_rows.read_sequence`` (whole blocks) against each layout's definition, element by
element (``RowLayout``'s doc: ``paged`` rows at ``kv[b, h, t]``, ``chunk`` rows
inside each (block, head) chunk of ``N * C`` elements, keys first, transposed or not), on a
cache filled with random numbers, blocks in a scrambled order, a partial last block."""

from __future__ import annotations

import pytest
import torch

from leyline_agent.kernels.paged_rows import RowLayout, read_rows, read_sequence

N, H, D = 8, 3, 4


def _by_definition(kv: torch.Tensor, layout: RowLayout, b: int, h: int, t: int):
    if layout.kind == "paged":
        return kv[b, h, t, :D], kv[b, h, t, D : 2 * D]
    chunk = kv.reshape(kv.shape[0], H, N * 2 * D)[b, h]
    keys = [chunk[d * N + t] if layout.keys_transposed else chunk[t * D + d] for d in range(D)]
    values = [chunk[N * D + t * D + d] for d in range(D)]
    return torch.stack(keys), torch.stack(values)


@pytest.mark.parametrize(
    "layout",
    [RowLayout("paged", D, D), RowLayout("chunk", D, D, True), RowLayout("chunk", D, D, False)],
)
@pytest.mark.parametrize("n", [1, N, 3 * N + 5])
def test_read_sequence_reads_each_row_where_the_layout_puts_it(layout, n):
    gen = torch.Generator().manual_seed(n)
    kv = torch.randn((10, H, N, 2 * D), generator=gen)
    blocks = torch.randperm(10, generator=gen)[: -(-n // N)]
    keys, values = read_sequence(kv, blocks, n, layout)
    assert keys.shape == (H, n, D) and values.shape == (H, n, D)
    for p in range(n):
        for h in range(H):
            k, v = _by_definition(kv, layout, int(blocks[p // N]), h, p % N)
            assert torch.equal(keys[h, p], k) and torch.equal(values[h, p], v), (p, h)
    slots = torch.tensor([int(blocks[p // N]) * N + p % N for p in range(n)])
    by_row = read_rows(kv, slots, layout)  # the row-by-row read agrees
    assert torch.equal(by_row[0].transpose(0, 1), keys)
    assert torch.equal(by_row[1].transpose(0, 1), values)


@pytest.mark.parametrize(
    "layout",
    [RowLayout("paged", D, D), RowLayout("chunk", D, D, True), RowLayout("chunk", D, D, False)],
)
@pytest.mark.parametrize(("offset", "n"), [(0, 2 * N), (3, 2 * N), (5, 4 * N + 1), (7, 3 * N - 7)])
def test_read_rows_of_a_run_and_of_scattered_slots_read_each_row_where_the_layout_puts_it(
    layout, offset, n
):
    gen = torch.Generator().manual_seed(offset * 100 + n)
    kv = torch.randn((12, H, N, 2 * D), generator=gen)
    blocks = torch.randperm(12, generator=gen)[: (offset + n - 1) // N + 1]
    run = torch.tensor([int(blocks[p // N]) * N + p % N for p in range(offset, offset + n)])
    scattered = run[torch.randperm(n, generator=gen)]  # the same rows, not a run
    for slots in (run, scattered):
        keys, values = read_rows(kv, slots, layout)
        assert keys.shape == (n, H, D) and values.shape == (n, H, D)
        for i, slot in enumerate(slots.tolist()):
            for h in range(H):
                k, v = _by_definition(kv, layout, slot // N, h, slot % N)
                assert torch.equal(keys[i, h], k) and torch.equal(values[i, h], v), (i, h)
