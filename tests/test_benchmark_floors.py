"""The engine's decode step that the per-step rows divide by (`workload.decode_step`).

The vLLM, SGLang and GPU rows take their floor from it: an engine decoding N
sequences for T tokens, less the same for one token, over T - 1. A simulated
engine whose prefill and decode steps have known costs, on a simulated clock,
must come out at exactly its decode step, whatever its prefill costs.
"""

import pytest

from benchmarks import workload


class SimulatedEngine:
    """Decodes on a clock of its own: a prefill, then one decode step per token after the
    first; a second column of the clock counts the tokens decoded."""

    def __init__(self, prefill: float, per_sequence: float, fixed: float):
        self.prefill, self.per_sequence, self.fixed = prefill, per_sequence, fixed
        self.seconds, self.tokens, self.calls = 0.0, 0, []

    def clock(self) -> tuple[float, int]:
        return self.seconds, self.tokens

    def decode(self, trace: workload.Trace, n: int, tokens: int) -> None:
        self.calls.append((n, tokens))
        self.seconds += self.prefill * n * len(trace.prompt)
        self.seconds += (tokens - 1) * (self.fixed + self.per_sequence * n)
        self.tokens += n * tokens


@pytest.mark.parametrize(("n", "steps"), [(10, 32), (32, 32), (4, 2)])
@pytest.mark.parametrize("prefill", [0.0, 0.004])
def test_the_decode_step_leaves_the_prefill_out(n, steps, prefill):
    engine = SimulatedEngine(prefill=prefill, per_sequence=0.0003, fixed=0.002)
    trace = workload.make_trace(n, steps, vocab=100)
    costs = workload.decode_step(engine.decode, trace, n, steps, engine.clock)
    assert engine.calls == [(n, 1), (n, steps)]
    (seconds, tokens), *rest = costs
    assert not rest
    assert seconds == pytest.approx(0.002 + 0.0003 * n, rel=1e-9)
    assert tokens == pytest.approx(n, rel=1e-9)  # N tokens a decode step, in every column
