"""Draws, log-normalisers and reads of `genlm.backend.draw`, against hand-computed values."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

from genlm.backend import draw
from genlm.backend.batching import take_batch_stats
from genlm.backend.draw import DRAW_METHODS, draw_from, logp_at, logsumexp_from, set_draw_method

# A row with mass on five of six columns (column 3 has none), unnormalised on purpose.
PROBS = np.array([0.1, 0.25, 0.05, 0.0, 0.4, 0.2])
with np.errstate(divide="ignore"):
    LOG_WEIGHTS = np.log(PROBS) + 1.7


@pytest.fixture(autouse=True)
def fresh_state():
    take_batch_stats()
    yield
    set_draw_method(None)
    take_batch_stats()


async def draws(rows, target=None):
    return await asyncio.gather(*(draw_from(row, target=target) for row in rows))


@pytest.mark.parametrize("method", DRAW_METHODS)
@pytest.mark.parametrize(
    "make_row",
    [
        lambda: torch.tensor(LOG_WEIGHTS, dtype=torch.float32),
        lambda: torch.tensor(LOG_WEIGHTS, dtype=torch.float64),
        lambda: torch.tensor(LOG_WEIGHTS, dtype=torch.bfloat16),
        lambda: LOG_WEIGHTS.astype(np.float32),
    ],
    ids=["float32", "float64", "bfloat16", "numpy"],
)
def test_frequencies_match_the_normalised_row(method, make_row):
    set_draw_method(method)
    torch.manual_seed(0)
    n = 6000
    row = make_row()
    results = asyncio.run(draws([row] * n))
    assert take_batch_stats() == {("draw", n): 1}  # one cohort, one reduction
    counts = np.bincount([index for index, _, _ in results], minlength=len(PROBS))
    expected = PROBS
    if isinstance(row, torch.Tensor) and row.dtype == torch.bfloat16:
        weights = row.float().numpy()
        expected = np.exp(weights - np.logaddexp.reduce(weights))
    # Within 4.5 standard errors of a binomial count, for every column (a false alarm
    # has odds below 1 in 10^4 per column at this seed-free bound; the seed fixes it).
    spread = 4.5 * np.sqrt(n * expected * (1 - expected))
    assert np.all(np.abs(counts - n * expected) <= spread), (counts, n * expected)
    assert counts[3] == 0  # no mass, never drawn
    # bfloat16 keeps 8 bits of the weights (1.7 + log p to about 0.01); the others 1e-5.
    low_precision = isinstance(row, torch.Tensor) and row.dtype == torch.bfloat16
    for index, logw, logp in results[:50]:
        assert logw == pytest.approx(1.7, abs=2e-2 if low_precision else 1e-5)
        assert logp == pytest.approx(math.log(expected[index]), abs=1e-5)


@pytest.mark.parametrize("method", DRAW_METHODS)
def test_frequencies_on_a_wide_row_with_mass_across_blocks(method):
    """Mass at block edges (the inverse CDF sums blocks of 256 columns), none in a whole
    block, some in the ragged last block; every other column has none."""
    set_draw_method(method)
    torch.manual_seed(5)
    width = 1000
    masses = {0: 0.05, 255: 0.2, 256: 0.15, 700: 0.3, 767: 0.1, 999: 0.2}  # 256-511: none
    row = torch.full((width,), -math.inf, dtype=torch.float64)
    for column, mass in masses.items():
        row[column] = math.log(mass)
    n = 8000
    results = asyncio.run(draws([row] * n))
    counts = np.bincount([index for index, _, _ in results], minlength=width)
    assert set(np.flatnonzero(counts)) <= set(masses)
    for column, mass in masses.items():
        assert abs(counts[column] - n * mass) <= 4.5 * math.sqrt(n * mass * (1 - mass))
        assert results[0][1] == pytest.approx(0.0, abs=1e-12)


def test_results_against_hand_computed_values():
    row = torch.log(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64))
    index, logw, logp = asyncio.run(draw_from(row))
    assert logw == pytest.approx(math.log(10.0), abs=1e-12)
    assert logp == pytest.approx(math.log((index + 1) / 10.0), abs=1e-12)
    assert asyncio.run(logsumexp_from(row)) == pytest.approx(math.log(10.0), abs=1e-12)
    assert asyncio.run(logp_at(row, 2)) == math.log(3.0)  # read back bit for bit


def test_float64_rows_read_back_to_1e_12():
    generator = torch.Generator().manual_seed(3)
    rows = [torch.randn(1000, dtype=torch.float64, generator=generator) * 4 for _ in range(8)]

    async def ask():
        return await asyncio.gather(
            *(logsumexp_from(row) for row in rows),
            *(logp_at(row, 7 * i) for i, row in enumerate(rows)),
            *(draw_from(row) for row in rows),
        )

    results = asyncio.run(ask())
    log_zs, values, drawn = results[:8], results[8:16], results[16:]
    for i, row in enumerate(rows):
        reference = math.log(math.fsum(math.exp(x) for x in row.tolist()))
        assert log_zs[i] == pytest.approx(reference, abs=1e-12)
        assert values[i] == row[7 * i].item()
        index, logw, logp = drawn[i]
        assert logw == pytest.approx(reference, abs=1e-12)
        assert logp == pytest.approx(row[index].item() - reference, abs=1e-12)


def test_importance_draws_weigh_under_the_target():
    proposal = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    target = torch.log(torch.tensor([0.2, 0.2, 0.6]))
    torch.manual_seed(1)
    results = asyncio.run(draws([proposal] * 200, target=target))
    seen = set()
    for index, logw, logp in results:
        seen.add(index)
        assert logp == pytest.approx(math.log([0.5, 0.25, 0.25][index]), abs=1e-6)
        assert logw == pytest.approx(math.log([0.2, 0.2, 0.6][index]) - logp, abs=1e-6)
    assert seen == {0, 1, 2}
    # The importance weights' mean estimates the target's total mass, 1.
    assert np.mean([math.exp(logw) for _, logw, _ in results]) == pytest.approx(1.0, abs=0.15)


def test_a_target_of_another_library_dtype_or_width():
    proposal = torch.log(torch.tensor([0.5, 0.5]))
    target = np.log(np.array([0.25, 0.75]))
    index, logw, logp = asyncio.run(draw_from(proposal, target=target))
    assert logw == pytest.approx(math.log([0.25, 0.75][index]) - math.log(0.5), abs=1e-6)
    with pytest.raises(ValueError, match="target has 3 entries; weights has 2"):
        asyncio.run(draw_from(proposal, target=torch.zeros(3)))


@pytest.mark.parametrize("method", DRAW_METHODS)
def test_a_row_without_support_does_not_poison_its_group(method):
    set_draw_method(method)
    torch.manual_seed(2)
    live = torch.log(torch.tensor([0.3, 0.7, 0.0]))
    dead = torch.full((3,), -math.inf)
    results = asyncio.run(draws([live, dead, live, dead]))
    assert take_batch_stats() == {("draw", 4): 1}
    for index, logw, logp in (results[0], results[2]):
        assert index in (0, 1)
        assert logw == pytest.approx(0.0, abs=1e-6)
        assert logp == pytest.approx(math.log([0.3, 0.7][index]), abs=1e-6)
    for index, logw, logp in (results[1], results[3]):
        assert 0 <= index < 3
        assert logw == logp == -math.inf
    assert asyncio.run(draw_from(dead, target=live))[1:] == (-math.inf, -math.inf)
    assert asyncio.run(logsumexp_from(dead)) == -math.inf


def test_asks_are_grouped_by_kind_library_device_dtype_and_width():
    rows32 = [torch.zeros(4) for _ in range(3)]

    async def ask():
        await asyncio.gather(
            *(draw_from(row) for row in rows32),
            draw_from(torch.zeros(4, dtype=torch.float64)),
            draw_from(np.zeros(4, dtype=np.float32)),
            draw_from(torch.zeros(5)),
            logsumexp_from(rows32[0]),
            logsumexp_from(rows32[1]),
            logp_at(rows32[0], 1),
        )

    asyncio.run(ask())
    expected = {("draw", 3): 1, ("draw", 1): 3, ("logsumexp", 2): 1, ("at", 1): 1}
    assert take_batch_stats() == expected
    assert take_batch_stats() == {}  # taken, then cleared


def test_asks_from_nested_gathers_meet_in_one_window():
    async def deferred(row, depth):
        for _ in range(depth):
            await asyncio.sleep(0)
        return await draw_from(row)

    async def ask():
        rows = [torch.zeros(3) for _ in range(9)]
        return await asyncio.gather(*(deferred(row, i % 3) for i, row in enumerate(rows)))

    asyncio.run(ask())
    assert take_batch_stats() == {("draw", 9): 1}


def test_a_bad_row_fails_only_its_own_caller():
    good = torch.log(torch.tensor([0.5, 0.5]))
    nan_row = torch.tensor([0.0, math.nan])
    inf_row = torch.tensor([0.0, math.inf])

    async def ask():
        return await asyncio.gather(
            draw_from(good),
            draw_from(nan_row),
            draw_from(inf_row),
            logsumexp_from(nan_row),
            draw_from(good),
            return_exceptions=True,
        )

    first, with_nan, with_inf, log_z_nan, last = asyncio.run(ask())
    assert isinstance(with_nan, ValueError) and "NaN or +inf" in str(with_nan)
    assert isinstance(with_inf, ValueError)
    assert isinstance(log_z_nan, ValueError)
    for index, logw, _ in (first, last):
        assert index in (0, 1) and logw == pytest.approx(0.0, abs=1e-6)


def test_a_failing_group_fails_its_callers_only(monkeypatch):
    def broken_pick(rows):
        if rows.shape[1] == 3:
            raise RuntimeError("picker broke")
        return torch.zeros(len(rows), dtype=torch.long), torch.logsumexp(rows, dim=1)

    set_draw_method("inverse_cdf")
    monkeypatch.setitem(draw._PICKERS, "inverse_cdf", broken_pick)

    async def ask():
        return await asyncio.gather(
            draw_from(torch.zeros(3)),
            draw_from(torch.zeros(3)),
            draw_from(torch.zeros(2)),
            logsumexp_from(torch.zeros(3)),
            return_exceptions=True,
        )

    broken_a, broken_b, fine, log_z = asyncio.run(ask())
    assert isinstance(broken_a, RuntimeError) and broken_a is broken_b  # one error, one group
    assert fine == (0, pytest.approx(math.log(2)), pytest.approx(-math.log(2)))
    assert log_z == pytest.approx(math.log(3))


def test_a_cancelled_caller_leaves_the_others_their_draws():
    async def ask():
        tasks = [asyncio.ensure_future(draw_from(torch.zeros(4))) for _ in range(5)]
        await asyncio.sleep(0)  # every ask is in the window
        tasks[0].cancel()
        tasks[3].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(ask())
    assert isinstance(results[0], asyncio.CancelledError)
    assert isinstance(results[3], asyncio.CancelledError)
    for i in (1, 2, 4):
        assert 0 <= results[i][0] < 4
    assert take_batch_stats() == {("draw", 3): 1}  # the cancelled asks were dropped


@pytest.mark.parametrize("method", DRAW_METHODS)
def test_the_same_seed_gives_the_same_draws_and_reads_consume_no_randomness(method):
    set_draw_method(method)
    rows = [torch.randn(50, generator=torch.Generator().manual_seed(i)) for i in range(6)]

    async def ask(with_reads):
        torch.manual_seed(11)
        asks = [draw_from(row) for row in rows]
        if with_reads:
            asks += [logsumexp_from(rows[0]), logp_at(rows[1], 3)]
        return [result[0] for result in (await asyncio.gather(*asks))[: len(rows)]]

    first = asyncio.run(ask(False))
    assert asyncio.run(ask(False)) == first
    assert asyncio.run(ask(True)) == first
    torch.manual_seed(12)
    assert [asyncio.run(draw_from(row))[0] for row in rows] != first


def test_bad_input_is_a_clear_error_at_the_call():
    with pytest.raises(TypeError, match="torch tensor or a numpy array"):
        asyncio.run(draw_from([0.0, 1.0]))
    with pytest.raises(ValueError, match="non-empty 1-D row"):
        asyncio.run(draw_from(torch.zeros(2, 3)))
    with pytest.raises(ValueError, match="non-empty 1-D row"):
        asyncio.run(logsumexp_from(np.zeros(0)))
    with pytest.raises(TypeError, match="must hold floats"):
        asyncio.run(draw_from(torch.zeros(3, dtype=torch.long)))
    with pytest.raises(ValueError, match="outside the row"):
        asyncio.run(logp_at(torch.zeros(3), 3))
    with pytest.raises(TypeError, match="index must be an int"):
        asyncio.run(logp_at(torch.zeros(3), 1.0))
    assert asyncio.run(logp_at(torch.arange(3.0), np.int64(2))) == 2.0
    assert asyncio.run(logp_at(torch.arange(3.0), torch.tensor(1))) == 1.0
    with pytest.raises(ValueError, match="unknown draw method 'top_k'"):
        set_draw_method("top_k")


def test_the_default_picker_follows_the_device():
    assert draw.draw_method("cpu") == "inverse_cdf"
    assert draw.draw_method("cuda") == "gumbel_max"
    set_draw_method("multinomial")
    assert draw.draw_method("cpu") == draw.draw_method("cuda") == "multinomial"
