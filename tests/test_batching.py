"""Tests of the shared auto-batcher against fake evaluators that record their batches."""

from __future__ import annotations

import asyncio

import pytest
import torch

from genlm.backend.batching import AutoBatcher, BatchAbandoned, join_batch, take_batch_stats

NEVER = 3600.0  # a timeout no test waits for: only the size trigger or a flush can fire
HANG_GUARD = 60.0  # wait_for limit that turns a hang into a failure (not a timing check)


class Recorder:
    """A sync evaluator: squares numbers, records each batch, fails on requested values."""

    def __init__(self, fail_on=()):
        self.batches: list[list] = []
        self.fail_on = set(fail_on)

    def __call__(self, requests):
        self.batches.append(list(requests))
        if self.fail_on & set(requests):
            raise ValueError(f"bad request in {requests}")
        return [r * r for r in requests]


class AsyncRecorder(Recorder):
    """An async evaluator that waits for `release` (when given) before answering."""

    def __init__(self, fail_on=(), gate=False):
        super().__init__(fail_on)
        self.release = asyncio.Event() if gate else None
        self.started = asyncio.Event()

    async def __call__(self, requests):
        self.batches.append(list(requests))
        self.started.set()
        if self.release is not None:
            await self.release.wait()
        if self.fail_on & set(requests):
            raise ValueError(f"bad request in {requests}")
        return [r * r for r in requests]


async def gather(*aws):
    return await asyncio.wait_for(asyncio.gather(*aws, return_exceptions=True), HANG_GUARD)


async def stream(batcher, values, until=lambda: False):
    """Queue one value per pass of the event loop (the loop never goes quiet); stop early
    once `until()` holds. Returns the queued values' futures."""
    loop = asyncio.get_running_loop()
    futures = []
    for value in values:
        if until():
            break
        futures.append(loop.create_future())
        batcher.add(value, futures[-1])
        await asyncio.sleep(0)
    return futures


@pytest.fixture(params=["sync", "async"])
def make_evaluator(request):
    return Recorder if request.param == "sync" else AsyncRecorder


def test_rejects_bad_settings():
    with pytest.raises(ValueError):
        AutoBatcher(Recorder(), batch_size=0)
    with pytest.raises(ValueError):
        AutoBatcher(Recorder(), timeout=-1)


async def test_a_gather_is_one_batch_once_the_loop_goes_quiet(make_evaluator):
    evaluate = make_evaluator()
    batcher = AutoBatcher(evaluate, batch_size=100, timeout=NEVER)
    assert await gather(*(batcher.submit(x) for x in (1, 2, 3))) == [1, 4, 9]
    assert evaluate.batches == [[1, 2, 3]]


async def test_a_gather_larger_than_batch_size_is_still_one_batch(make_evaluator):
    evaluate = make_evaluator()
    batcher = AutoBatcher(evaluate, batch_size=2, timeout=NEVER)
    assert await gather(*(batcher.submit(x) for x in range(5))) == [0, 1, 4, 9, 16]
    assert evaluate.batches == [[0, 1, 2, 3, 4]]


async def test_callers_that_await_on_the_way_still_join_the_batch(make_evaluator):
    async def particle(x):
        for _ in range(x):  # x passes of the loop before the request
            await asyncio.sleep(0)
        return await batcher.submit(x)

    evaluate = make_evaluator()
    batcher = AutoBatcher(evaluate, batch_size=100, timeout=NEVER)
    assert await gather(*(particle(x) for x in (3, 0, 2, 1, 0))) == [9, 0, 4, 1, 0]
    assert [sorted(batch) for batch in evaluate.batches] == [[0, 0, 1, 2, 3]]


async def test_a_stream_is_cut_into_batches_of_batch_size(make_evaluator):
    evaluate = make_evaluator()
    batcher = AutoBatcher(evaluate, batch_size=3, timeout=NEVER)
    futures = await stream(batcher, range(7))
    assert await gather(*futures) == [x * x for x in range(7)]
    if make_evaluator is Recorder:  # an async batch takes what arrived until its task ran
        assert evaluate.batches == [[0, 1, 2], [3, 4, 5], [6]]
    assert evaluate.batches[0][:3] == [0, 1, 2] and len(evaluate.batches) >= 2


async def test_timeout_runs_a_batch_while_requests_keep_coming(make_evaluator):
    evaluate = make_evaluator()
    batcher = AutoBatcher(evaluate, batch_size=10**9, timeout=0.005)
    futures = await stream(batcher, range(10**7), until=lambda: bool(evaluate.batches))
    await gather(*futures)
    first = evaluate.batches[0]
    assert first == list(range(len(first))) and len(first) > 1  # neither quiet nor full


async def test_duplicates_are_evaluated_once_per_batch(make_evaluator):
    evaluate = make_evaluator()
    batcher = AutoBatcher(evaluate, batch_size=100, timeout=0.001, key=lambda r: r)
    assert await gather(*(batcher.submit(x) for x in (5, 6, 5, 5))) == [25, 36, 25, 25]
    assert evaluate.batches == [[5, 6]]


async def test_without_key_every_request_is_evaluated():
    evaluate = Recorder()
    batcher = AutoBatcher(evaluate, batch_size=100, timeout=0.001)
    await gather(batcher.submit(5), batcher.submit(5))
    assert evaluate.batches == [[5, 5]]


async def test_duplicate_counts_once_towards_batch_size():
    evaluate = Recorder()
    batcher = AutoBatcher(evaluate, batch_size=2, timeout=NEVER, key=lambda r: r)
    assert await gather(batcher.submit(1), batcher.submit(1), batcher.submit(2)) == [1, 1, 4]
    assert evaluate.batches == [[1, 2]]


async def test_a_request_in_flight_is_joined_not_resubmitted():
    evaluate = AsyncRecorder(gate=True)
    batcher = AutoBatcher(evaluate, batch_size=100, timeout=0.001, key=lambda r: r)
    first = asyncio.ensure_future(batcher.submit(7))
    await asyncio.wait_for(evaluate.started.wait(), HANG_GUARD)
    joined = asyncio.ensure_future(batcher.submit(7))
    other = asyncio.ensure_future(batcher.submit(8))
    await asyncio.sleep(0.01)  # let the second request's timer fire; its batch must wait
    evaluate.release.set()
    assert await gather(first, joined, other) == [49, 49, 64]
    assert evaluate.batches == [[7], [8]]


async def test_async_batches_run_one_at_a_time():
    evaluate = AsyncRecorder(gate=True)
    batcher = AutoBatcher(evaluate, batch_size=1, timeout=NEVER)
    tasks = [asyncio.ensure_future(batcher.submit(1))]
    await asyncio.wait_for(evaluate.started.wait(), HANG_GUARD)
    tasks += [asyncio.ensure_future(batcher.submit(x)) for x in (2, 3)]
    for _ in range(10):
        await asyncio.sleep(0)
    assert evaluate.batches == [[1]]  # the others wait for the running batch
    evaluate.release.set()
    assert await gather(*tasks) == [1, 4, 9]
    assert evaluate.batches == [[1], [2, 3]]


async def test_an_exception_reaches_exactly_its_batch(make_evaluator):
    evaluate = make_evaluator(fail_on={13})
    batcher = AutoBatcher(evaluate, batch_size=2, timeout=NEVER)
    failed = await gather(batcher.submit(1), batcher.submit(13))
    assert all(isinstance(o, ValueError) for o in failed)
    assert failed[0] is failed[1]  # the evaluator's own exception
    assert await gather(batcher.submit(2), batcher.submit(3)) == [4, 9]
    assert evaluate.batches == [[1, 13], [2, 3]]


async def test_an_exception_reaches_callers_that_joined_in_flight():
    evaluate = AsyncRecorder(fail_on={13}, gate=True)
    batcher = AutoBatcher(evaluate, batch_size=100, timeout=0.001, key=lambda r: r)
    first = asyncio.ensure_future(batcher.submit(13))
    await asyncio.wait_for(evaluate.started.wait(), HANG_GUARD)
    joined = asyncio.ensure_future(batcher.submit(13))
    await asyncio.sleep(0)
    evaluate.release.set()
    outcomes = await gather(first, joined)
    assert all(isinstance(o, ValueError) for o in outcomes)
    assert await gather(batcher.submit(4)) == [16]


async def test_wrong_number_of_results_is_an_error_not_a_hang():
    batcher = AutoBatcher(lambda requests: [0], batch_size=2, timeout=NEVER)
    outcomes = await gather(batcher.submit(1), batcher.submit(2))
    assert all(isinstance(o, RuntimeError) for o in outcomes)


async def test_a_non_sequence_result_is_an_error_not_a_hang():
    async def evaluate(requests):
        return None

    batcher = AutoBatcher(evaluate, batch_size=2, timeout=NEVER)
    outcomes = await gather(batcher.submit(1), batcher.submit(2))
    assert all(isinstance(o, TypeError) for o in outcomes)


class FailsAt(list):
    """Results whose item `bad` cannot be read."""

    def __init__(self, items, bad):
        super().__init__(items)
        self.bad = bad

    def __getitem__(self, index):
        if index == self.bad:
            raise IndexError(f"result {index} is unreadable")
        return super().__getitem__(index)


class Uncopyable:
    """A result whose copy for a further caller fails."""

    def clone(self):
        raise MemoryError("no memory for a copy")


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_result_that_cannot_be_delivered_is_an_error_not_a_hang(kind):
    def evaluate(requests):
        return FailsAt(requests, bad=1)

    async def evaluate_async(requests):
        return evaluate(requests)

    batcher = AutoBatcher(evaluate if kind == "sync" else evaluate_async, batch_size=3)
    outcomes = await gather(batcher.submit(1), batcher.submit(2), batcher.submit(3))
    assert outcomes[0] == 1  # delivered before the failure
    assert all(isinstance(o, IndexError) for o in outcomes[1:])


async def test_a_failed_copy_for_a_further_caller_is_an_error_not_a_hang():
    batcher = AutoBatcher(lambda requests: [Uncopyable()], batch_size=2, key=lambda r: r)
    first, second = await gather(batcher.submit(7), batcher.submit(7))
    assert isinstance(first, Uncopyable) and isinstance(second, MemoryError)


async def test_a_batched_tensor_result_gives_each_caller_its_row():
    batcher = AutoBatcher(lambda requests: torch.tensor(requests) * 2, batch_size=2)
    rows = await gather(batcher.submit([1, 2]), batcher.submit([3, 4]))
    assert [row.tolist() for row in rows] == [[2, 4], [6, 8]]


async def test_cancelled_callers_are_skipped(make_evaluator):
    evaluate = make_evaluator()
    batcher = AutoBatcher(evaluate, batch_size=100, timeout=0.001, key=lambda r: r)
    cancelled = asyncio.ensure_future(batcher.submit(1))
    shared_cancelled = asyncio.ensure_future(batcher.submit(2))
    shared_kept = asyncio.ensure_future(batcher.submit(2))
    await asyncio.sleep(0)  # all three are queued
    cancelled.cancel()
    shared_cancelled.cancel()
    assert await gather(shared_kept) == [4]
    assert evaluate.batches == [[2]]  # 1 had no caller left; 2 still had one
    assert cancelled.cancelled() and shared_cancelled.cancelled()


async def test_reset_cancels_waiting_callers(make_evaluator):
    evaluate = make_evaluator()
    batcher = AutoBatcher(evaluate, batch_size=100, timeout=NEVER)
    tasks = [asyncio.ensure_future(batcher.submit(x)) for x in (1, 2)]
    await asyncio.sleep(0)
    assert batcher.pending == [1, 2]
    batcher.reset()
    outcomes = await gather(*tasks)
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)
    assert batcher.pending == [] and evaluate.batches == []
    batcher.timeout = 0.001
    assert await gather(batcher.submit(3)) == [9]


async def test_reset_cancels_callers_of_a_running_batch():
    evaluate = AsyncRecorder(gate=True)
    batcher = AutoBatcher(evaluate, batch_size=1, timeout=NEVER)
    running = asyncio.ensure_future(batcher.submit(1))
    await asyncio.wait_for(evaluate.started.wait(), HANG_GUARD)
    batcher.reset()
    outcomes = await gather(running)
    assert isinstance(outcomes[0], asyncio.CancelledError)
    evaluate.release.set()
    await asyncio.wait_for(batcher.aclose(), HANG_GUARD)
    assert await gather(batcher.submit(2)) == [4]


def test_successive_event_loops_and_creation_outside_a_loop(make_evaluator):
    batcher = AutoBatcher(make_evaluator(), batch_size=2, timeout=0.001)

    async def run(values):
        return await gather(*(batcher.submit(v) for v in values))

    assert asyncio.run(run([1, 2, 3])) == [1, 4, 9]
    assert asyncio.run(run([4])) == [16]


def test_a_run_abandoned_mid_batch_does_not_break_the_next_loop():
    async def abandon():
        batcher.timeout = NEVER
        asyncio.ensure_future(batcher.submit(1))  # left queued when the loop ends
        await asyncio.sleep(0)

    async def use():
        batcher.timeout = 0.001
        return await gather(batcher.submit(2))

    batcher = AutoBatcher(Recorder(), batch_size=10, timeout=NEVER)
    asyncio.run(abandon())
    assert asyncio.run(use()) == [4]


async def test_flush_evaluates_everything_queued_synchronously():
    evaluate = Recorder()
    batcher = AutoBatcher(evaluate, batch_size=2, timeout=NEVER)
    loop = asyncio.get_running_loop()
    futures = [loop.create_future() for _ in range(3)]
    for value, future in zip((1, 2, 3), futures, strict=True):
        batcher.add(value, future)
    assert not any(f.done() for f in futures)  # batches run from the event loop
    batcher.flush()
    assert [f.result() for f in futures] == [1, 4, 9]
    assert evaluate.batches == [[1, 2, 3]]
    batcher.flush()  # nothing queued: no call
    await asyncio.sleep(0.01)  # nor from the loop
    assert len(evaluate.batches) == 1


async def test_flush_needs_a_sync_evaluator():
    batcher = AutoBatcher(AsyncRecorder())
    with pytest.raises(TypeError):
        batcher.flush()


async def test_batch_size_and_timeout_can_change_between_calls():
    evaluate = Recorder()
    batcher = AutoBatcher(evaluate, batch_size=10, timeout=NEVER)
    batcher.batch_size = 2
    assert await gather(*await stream(batcher, (1, 2, 3, 4))) == [1, 4, 9, 16]
    batcher.batch_size = 3
    assert await gather(*await stream(batcher, (5, 6, 7, 8))) == [25, 36, 49, 64]
    assert evaluate.batches == [[1, 2], [3, 4], [5, 6, 7], [8]]
    batcher.batch_size, batcher.timeout = 10**9, 0.001
    await gather(*await stream(batcher, range(10**7), until=lambda: len(evaluate.batches) > 4))
    assert len(evaluate.batches[4]) > 1  # the new timeout cut a stream


class TensorRecorder(Recorder):
    """Answers each request with a fresh tensor holding its square."""

    def __call__(self, requests):
        return [torch.full((4,), float(r)) for r in super().__call__(requests)]


async def test_callers_sharing_a_request_each_own_their_result():
    batcher = AutoBatcher(TensorRecorder(), batch_size=2, timeout=NEVER, key=lambda r: r)
    first, second, other = await gather(batcher.submit(2), batcher.submit(2), batcher.submit(3))
    assert first.data_ptr() != second.data_ptr()
    first.fill_(-1.0)  # one caller changes its result in place
    assert torch.equal(second, torch.full((4,), 4.0)) and torch.equal(other, torch.full((4,), 9.0))


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_threads_with_their_own_loops_are_all_served(kind):
    """Each thread runs its own event loop against one batcher; nobody is cancelled."""
    import threading

    evaluate = TensorRecorder() if kind == "sync" else AsyncRecorder()
    batcher = AutoBatcher(evaluate, batch_size=4, timeout=0.005, key=lambda r: r)
    barrier = threading.Barrier(2)
    outcomes: dict[int, list] = {}

    def worker(offset: int) -> None:
        async def run() -> list:
            barrier.wait()  # both loops submit at the same time
            results = []
            for step in range(20):
                batch = [offset + 10 * step + i for i in range(3)]
                results.append(await gather(*(batcher.submit(x) for x in batch)))
            return results

        outcomes[offset] = asyncio.run(run())

    threads = [threading.Thread(target=worker, args=(offset,)) for offset in (0, 1000)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG_GUARD)
    for offset in (0, 1000):
        for step, results in enumerate(outcomes[offset]):
            expected = [(offset + 10 * step + i) ** 2 for i in range(3)]
            got = [float(r[0]) if isinstance(r, torch.Tensor) else r for r in results]
            assert got == expected


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_an_exception_returned_for_one_request_reaches_only_its_callers(kind):
    def answers(requests):
        return [ValueError(f"no {r}") if r == 2 else r * r for r in requests]

    async def async_answers(requests):
        return answers(requests)

    evaluate = answers if kind == "sync" else async_answers
    batcher = AutoBatcher(evaluate, batch_size=3, timeout=NEVER, key=lambda r: r)
    outcomes = await gather(
        batcher.submit(1), batcher.submit(2), batcher.submit(2), batcher.submit(3)
    )
    assert outcomes[0] == 1 and outcomes[3] == 9
    assert all(isinstance(o, ValueError) and str(o) == "no 2" for o in outcomes[1:3])


def test_a_cancelled_batch_task_fails_its_callers_with_batch_abandoned():
    recorder = AsyncRecorder(gate=True)
    batcher = AutoBatcher(recorder, batch_size=2, timeout=NEVER)

    async def main():
        callers = [asyncio.ensure_future(batcher.submit(n)) for n in (2, 3)]
        await asyncio.wait_for(recorder.started.wait(), HANG_GUARD)
        for task in asyncio.all_tasks():  # what cancels every task of a loop does
            if task not in callers and task is not asyncio.current_task():
                task.cancel()
        return await asyncio.wait_for(asyncio.gather(*callers, return_exceptions=True), HANG_GUARD)

    results = asyncio.run(main())
    assert all(isinstance(r, BatchAbandoned) for r in results)
    assert not any(isinstance(r, asyncio.CancelledError) for r in results)


def test_join_batch_evaluates_each_group_once_in_order_of_arrival():
    calls = []

    def total(items):
        calls.append(list(items))
        return [sum(items)] * len(items)

    def fail(items):
        raise KeyError("no")

    async def main():
        return await asyncio.gather(
            join_batch("sum", 1, total, group="a"),
            join_batch("sum", 10, total, group="b"),
            join_batch("sum", 2, total, group="a"),
            join_batch("broken", 0, fail),
            return_exceptions=True,
        )

    take_batch_stats()
    a1, b, a2, broken = asyncio.run(main())
    assert (a1, b, a2) == (3, 10, 3)
    assert calls == [[1, 2], [10]]
    assert isinstance(broken, KeyError)
    assert take_batch_stats() == {("sum", 2): 1, ("sum", 1): 1, ("broken", 1): 1}
