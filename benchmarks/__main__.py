"""`python -m benchmarks NAME [options]`: one benchmark, `all` of them, or the page."""

import argparse
import importlib
import json
import sys
from dataclasses import asdict
from pathlib import Path

from benchmarks import core

COMMANDS = {  # name -> (module, what it measures)
    "decode_vocab": ("tokenization", "decode_vocab against the per-token decode"),
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
    "gpu_smc": ("gpu_smc", "the GPU workload (random 1.07B Llama) on vLLM and transformers"),
    "all": ("suite", "run what fits this machine; record it in docs/performance.json"),
    "page": ("page", "redraw the performance page's table and picture from its JSON"),
}


def main(argv: list[str]) -> None:
    """Run the command `argv` names."""
    if argv[:1] == ["child"]:  # a measurement in a fresh process (`core.in_child`)
        return core.child_main(*argv[1:])
    if not argv or argv[0] not in COMMANDS:
        listing = "\n".join(f"  {name:<14}{text}" for name, (_, text) in COMMANDS.items())
        parser = argparse.ArgumentParser(
            prog="python -m benchmarks",
            description=__doc__,
            epilog=f"commands:\n{listing}\n\n`python -m benchmarks NAME --help`: its options.",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        parser.add_argument("name", choices=list(COMMANDS), metavar="NAME")
        parser.parse_args(argv)
    name = argv[0]
    module = importlib.import_module(f"benchmarks.{COMMANDS[name][0]}")
    parser = argparse.ArgumentParser(
        prog=f"python -m benchmarks {name}",
        description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    core.add_options(parser, module.OPTIONS)
    if name not in ("all", "page"):
        parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv[1:])
    module.run(args)
    if getattr(args, "json", None):  # the figures recorded, as `all` reads them back
        args.json.write_text(json.dumps({"figures": [asdict(f) for f in core.FIGURES]}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
