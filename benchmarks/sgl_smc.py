"""SGLang on the CPU (SmolLM2-135M, bfloat16; run it in the environment `scripts/setup_sglang.sh`
builds: `.venv-sglang-0.5.18/bin/python -m benchmarks sgl_smc`). Scoring: all prefixes of a
sequence in one cold call against ONE request of the whole sequence. SMC through
`AsyncSGLTransformer` against the engine's own decode: N sequences of the same prompt length
decoding T tokens together on the same scheduler. Per step (`sgl_smc/step/NxT`, and
`/no-resampling`): the mean step after the prompt's against that decode's step with the prefill
excluded (`workload.decode_step`)."""

import os
import time
from functools import partial
from statistics import median
from typing import Any

import torch

from benchmarks.core import Figure, alternate, record, timed
from benchmarks.scoring import prefix_rows
from benchmarks.workload import Trace, cold, smc_figures, step_figures

OPTIONS = {"configs": "10x32,32x32", "lengths": ("64,256", "sequence lengths (scoring)")}
OPTIONS["repeats"] = 3


def engine_opts() -> dict:
    """The CPU engine's options: bfloat16, AMX attention where the CPU has AMX."""
    amx = torch.cpu._is_amx_tile_supported()
    attention = "intel_amx" if amx else "torch_native"
    return {"device": "cpu", "dtype": "bfloat16", "attention_backend": attention}


def one_request(lm: Any, ids: list[int]) -> tuple[float, None]:
    """Seconds of ONE request of the whole sequence (its last row), cold."""
    cold(lm)
    return timed(lm.next_token_logprobs_sync, ids)[0], None


def decode_floor(lm: Any, trace: Trace, n: int, steps: int) -> None:
    """N requests of the trace's prompt, each decoding `steps` tokens, run together to the end
    on the backend's scheduler (greedy, end of sequence ignored)."""
    cold(lm)
    driver = lm._driver
    requests = [
        driver.request(f"floor-{time.monotonic_ns()}-{i}", trace.prompt, steps, ignore_eos=True)
        for i in range(n)
    ]
    driver.scheduler.process_input_requests(requests)
    while driver.step():
        pass


def measure_scoring(lm: Any, lengths: list[int], repeats: int) -> None:
    """Record `sgl_smc/scoring/LENGTH`: every prefix in one call against one request."""
    generator = torch.Generator().manual_seed(0)
    for length in lengths:
        times: dict[str, list[float]] = {}
        for repeat in range(repeats):
            ids = torch.randint(0, lm.vocab_size, (length,), generator=generator).tolist()
            runs = {"ours": partial(prefix_rows, lm, ids), "floor": partial(one_request, lm, ids)}
            for name, results in alternate(runs, 1, first=repeat).items():
                times.setdefault(name, []).append(results[0][0])
        ours, floor = median(times["ours"]), median(times["floor"])
        label = f"all prefixes of {length} tokens in one call, cold (SGLang CPU)"
        notes = {"one request s": floor, "prefixes": length}
        record(Figure(f"sgl_smc/scoring/{length}", label, "s", ours, floor, notes=notes))


def run(args: Any) -> None:
    """Start the engine, then the scoring and the SMC figures."""
    from genlm.backend import assets
    from genlm.backend.llm.sgl import AsyncSGLTransformer

    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    torch.manual_seed(0)
    path = str(assets.smollm2(fetch=False))
    with AsyncSGLTransformer.from_name(path, engine_opts=engine_opts()) as lm:
        measure_scoring(lm, [int(length) for length in args.lengths.split(",")], args.repeats)
        floor = partial(decode_floor, lm)
        smc_figures("sgl_smc", lm, floor, args.configs, args.repeats, "", warm_up=True)
        step_figures("sgl_smc", lm, floor, args.configs, args.repeats)
