"""`python -m benchmarks NAME [options]`: one benchmark, `all` of them, or the page."""

import argparse
import importlib
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import core

COMMANDS = {  # name -> (module, what it measures)
    "decode_vocab": ("tokenization", "decode_vocab against the per-token decode"),
    "draws": ("draws", "N draws from a step's rows: one cohort against N per-row draws"),
    "trie": ("trie", "the tries against a dict trie; --device cuda: the CUDA path"),
    "hf_smc": ("hf_smc", "SMC through AsyncTransformer against a batched decode; KV budget"),
    "overhead": ("overhead", "per-step overhead of transformers and vLLM on the tiny models"),
    "scoring": ("scoring", "all prefixes in one call; SMC with a PromptedLLM critic"),
    "memory": ("memory", "peak memory and time at N=256 to 2048 particles"),
    "launches": ("launches", "operations, host syncs and bytes per SMC step (a GPU proxy)"),
    "released": ("released", "this project against genlm-backend 0.3.1, fresh processes"),
    "vllm_smc": ("vllm_smc", "SMC through AsyncVirtualLM against LLM.generate per step"),
    "vllm_tp": ("vllm_tp", "one vLLM worker against two tensor-parallel workers"),
    "mlx_smc": ("mlx_smc", "SMC through AsyncMlxLM against a hand-written MLX decode"),
    "sgl_smc": ("sgl_smc", "SGLang on the CPU: scoring against one request, SMC against decode"),
    "gpu_smc": ("gpu_smc", "the GPU workload (random 1.07B Llama) on vLLM and transformers"),
    "all": ("suite", "run what fits this machine; record it in docs/performance.json"),
    "page": ("page", "redraw the performance page's table and picture from its JSON"),
}
HELP = {"configs": "NxT,NxT,...: particles x steps", "threads": "torch threads (0: torch's)"}
HELP["repeats"] = "runs of each measurement (medians)"


def add_options(parser: argparse.ArgumentParser, options: dict[str, Any]) -> None:
    """Add `options` (`skip_hf`: `--skip-hf`) -> default, or (default, help; else `HELP`'s):
    False for a flag, choices (the first the default), a dict for JSON, None for a string."""
    for name, value in options.items():
        default, text = value if isinstance(value, tuple) else (value, HELP.get(name))
        flag, kind = "--" + name.replace("_", "-"), type(default)
        if default is False:
            parser.add_argument(flag, action="store_true", help=text)
        elif isinstance(default, list):
            parser.add_argument(flag, choices=default, default=default[0], help=text)
        else:
            kind = {dict: json.loads, type(None): str}.get(kind, kind)
            parser.add_argument(flag, type=kind, default=default, help=text)


def child(target: str, arguments: str) -> None:
    """The child's side of `core.in_child`: call the function, print its result."""
    module, _, name = target.partition(":")
    value = getattr(importlib.import_module(module), name)(**json.loads(arguments))
    backend = sys.modules.get("genlm.backend")
    print(core.RESULT + json.dumps({"module": backend and backend.__file__, "value": value}))


def main(argv: list[str]) -> None:
    """Run the command `argv` names."""
    if argv[:1] == ["child"]:  # a measurement in a fresh process
        return child(*argv[1:])
    name = argv[0] if argv else None
    listing = "\n".join(f"  {name:<14}{text}" for name, (_, text) in COMMANDS.items())
    module = name in COMMANDS and importlib.import_module(f"benchmarks.{COMMANDS[name][0]}")
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks" + f" {name}" * bool(module),
        description=module.__doc__ if module else __doc__,
        epilog=None if module else f"commands:\n{listing}\n\n`NAME --help`: its options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if not module:  # no command named: the listing, or argparse's error
        parser.add_argument("name", choices=list(COMMANDS), metavar="NAME")
        parser.parse_args(argv)
    add_options(parser, module.OPTIONS)
    if name not in ("all", "page"):
        parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv[1:])
    module.run(args)
    if getattr(args, "json", None):  # the figures recorded, as `all` reads them back
        args.json.write_text(json.dumps({"figures": [asdict(f) for f in core.FIGURES]}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
