"""This project against the released genlm-backend 0.3.1 in alternating fresh processes: `hf`
(per step; its floor in each process), `trie`, `clients` (same work in both), `scoring`. Medians.
"""

import argparse
import asyncio
import contextlib
import contextvars
import inspect
import random
from collections import Counter
from functools import partial
from typing import Any

from benchmarks.core import Figure, compare, in_child, record, released_folder, set_threads, timed

PROGRAMS = {
    "control-regex": "genlm-control: regex-constrained SMC (`AWRS`, 8 particles, ≤ 24 tokens)",
    "control-critic": "genlm-control: the same with a `PromptedLLM` critic",
    "llamppl": "llamppl: avoid-a-letter model, `smc_standard`, 8 particles",
}
SETTINGS = {  # hf part: name -> label, batch size (None: its default, 0: N), `cache_kv` first
    "defaults": ("defaults", None, False),
    "cache_kv": ("defaults after `cache_kv(prompt)`", None, True),
    "batch_size": ("`batch_size=N`", 0, False),
}
QUERIES = ("next_token_logprobs", "batch_next_token_logprobs")
QUERIES += tuple(f"{name}_sync" for name in QUERIES)
SCORING = {"parts": ["scoring", "critic"], "lengths": [16, 64, 256], "configs": "8x32"}
OPTIONS = {"released": (None, "a folder holding genlm-backend 0.3.1")}
OPTIONS["parts"] = ("hf,trie", "hf, trie, clients and/or scoring")
OPTIONS |= {"repeats": (3, "processes per version"), "configs": ("10x32,32x16", "hf part")}
OPTIONS["threads"] = 0


def child_hf(model: str, configs: str, threads: int) -> dict:
    """Per config: ms per step of the floor and of each setting, and the largest error."""
    from benchmarks import workload as w

    hf_model, lm = w.transformer(model, threads)
    default, figures = lm.batch_size, {}
    for n, steps in w.parse_configs(configs):
        trace, sampled = w.make_trace(n, steps, len(lm.tokenizer)), {}
        w.run_reference(hf_model, trace, n, steps)  # warm-up
        row = figures[f"{n}x{steps}"] = {}
        row["floor"] = 1e3 * w.median_of(w.run_reference(hf_model, trace, n, steps))
        backend = partial(w.stamped_backend, lm, trace, n, steps, sampled=sampled)
        for name, (_, batch_size, cache_kv) in SETTINGS.items():
            lm.batch_size = default if batch_size is None else batch_size or n
            row[name] = 1e3 * w.median_of(backend(cache_kv=cache_kv))
        row["error"] = w.max_error(sampled, lm.next_token_logprobs_uncached)
    return figures


def child_trie(tokenizer: str, threads: int) -> list[dict]:
    """Both classes' figures (wall and CPU ms), each version's `decode_vocab` first."""
    from benchmarks import trie

    set_threads(threads)
    vocab, probs, logprobs = trie.weights(tokenizer)
    return [trie.time_class(partial(c, vocab), probs, logprobs, 15, False) for c in trie.CLASSES]


def count_calls(lm: Any) -> Counter:
    """Count the client's calls of `lm`'s query methods (outermost only), by name."""
    calls, inside = Counter(), contextvars.ContextVar("inside", default=False)

    @contextlib.contextmanager
    def call(name: str) -> Any:
        if not inside.get():
            calls[name] += 1
        token = inside.set(True)
        try:
            yield
        finally:
            inside.reset(token)

    @contextlib.asynccontextmanager
    async def call_async(name: str) -> Any:  # as a decorator: around the awaited call
        with call(name):
            yield

    for name in filter(partial(hasattr, lm), QUERIES):
        method = getattr(lm, name)
        counter = call_async if inspect.iscoroutinefunction(method) else call
        setattr(lm, name, counter(name)(method))
    return calls


def control_program(model: str, with_critic: bool) -> tuple[Any, Counter]:
    """genlm-control: AWRS over a `PromptedLLM` and a regex (and a second one as critic)."""
    from genlm.control import AWRS, BoolFSA, PromptedLLM

    llm = PromptedLLM.from_name(model, backend="hf")
    calls = count_calls(llm.model)
    llm.set_prompt_from_str("Five fruits: apples, pears, plums, figs and limes. Five colours:")
    fsa = BoolFSA.from_regex(r" [a-z]+, [a-z]+, [a-z]+, [a-z]+ and [a-z]+\.")
    sampler, critic = AWRS(llm, fsa.coerce(llm, f=b"".join), seed=0), None
    if with_critic:
        critic = llm.spawn()
        critic.set_prompt_from_str("Five warm colours:")
    return sampler.smc(n_particles=8, ess_threshold=0.5, max_tokens=24, critic=critic), calls


def llamppl_program(model: str) -> tuple[Any, Counter]:
    """llamppl: its README's model (continue a prompt avoiding a letter), `smc_standard`."""
    from llamppl import CachedCausalLM, LMContext, Model, smc_standard

    lm = CachedCausalLM.from_pretrained(model, backend="hf")
    calls = count_calls(lm.model)

    class AvoidLetter(Model):
        def __init__(self, prompt: str, letter: str) -> None:
            super().__init__()
            self.context, self.generated = LMContext(lm, prompt), 0
            self.forbidden = {i for i, text in enumerate(lm.str_vocab) if letter in text}

        async def step(self) -> None:
            await self.observe(self.context.mask_dist(self.forbidden), False)
            token = await self.sample(self.context.next_token())
            self.generated += 1
            ends = token.token_id == lm.tokenizer.eos_token_id or str(token) in (".", "!", "?")
            if ends or self.generated == 24:
                self.finish()

        def immutable_properties(self) -> set[str]:
            return {"forbidden"}

    return smc_standard(AvoidLetter("The weather today is expected to be", "e"), 8), calls


def child_clients(model: str, program: str, threads: int) -> dict:
    """Seconds to load and to run one client program, the work it did, and its results."""
    import numpy as np
    import torch

    set_threads(threads)
    load = partial(control_program, with_critic=program == "control-critic")
    load_s, _, (sampler, calls) = timed(llamppl_program if program == "llamppl" else load, model)
    for seed in (random.seed, np.random.seed, torch.manual_seed):
        seed(0)
    run_s, _, result = timed(asyncio.run, sampler)
    if program == "llamppl":
        tokens, output = sum(p.generated for p in result), sorted(str(p.context) for p in result)
    else:
        tokens = sum(len(context) for context in result.contexts)
        output = sorted((round(float(p), 3), t) for t, p in result.decoded_posterior.items())
    figures = {"load s": load_s, "run s": run_s, "tokens": tokens, "output": repr(output)}
    return figures | {"backend calls": repr(dict(sorted(calls.items())))}


def run(args: argparse.Namespace) -> None:
    """Run every part on both versions, alternating processes; record the figures."""
    from benchmarks import scoring, trie
    from genlm.backend import assets

    folder, parts = released_folder(args.released), args.parts.split(",")
    model, qwen2 = str(assets.smollm2()), str(assets.tokenizer("qwen2"))

    def both(target: str, **kwargs: Any) -> Any:
        """`target`'s medians in this project's children and in 0.3.1's, alternated."""
        child = partial(in_child, target, threads=args.threads, **kwargs)
        runs = {"ours": child, "released": partial(child, released=folder)}
        return compare(runs, args.repeats).values()

    if "hf" in parts:
        ours, theirs = both("benchmarks.released:child_hf", model=model, configs=args.configs)
        for config, row in ours.items():
            old, (n, steps) = theirs[config], config.split("x")
            notes = {"error, ours / 0.3.1": (row["error"], old["error"])}
            for name, (label, *_) in SETTINGS.items():
                times = row[name], row["floor"], old[name], old["floor"]
                workload = f"N={n}, T={steps}, {label}"
                record(Figure(f"hf_released/{config}/{name}", workload, "ms", *times, notes=notes))
    if "trie" in parts:
        ours, theirs = both("benchmarks.released:child_trie", tokenizer=qwen2)
        for name, (label, *_) in trie.FIGURES.items():
            mine, old = (tuple(result[name][0] for result in version) for version in (ours, theirs))
            record(Figure(f"trie/{name}", label, "ms", mine, released=old, released_only=True))
    if "scoring" in parts:
        ours, theirs = both("benchmarks.scoring:child", **SCORING, repeats=[1, 1], model=model)
        scoring.record_all(ours, released=theirs)
    for program in PROGRAMS if "clients" in parts else ():
        ours, theirs = both("benchmarks.released:child_clients", model=model, program=program)
        same = {key: ours[key] == theirs[key] for key in ("tokens", "backend calls", "output")}
        notes = {"load s, ours / 0.3.1": (ours["load s"], theirs["load s"]), **same}
        if not all(same.values()):
            notes |= {"ours": ours["output"], "0.3.1": theirs["output"]}
        seconds = ours["run s"], None, theirs["run s"]
        record(Figure(f"clients/{program}", PROGRAMS[program], "s", *seconds, notes=notes))
