#!/usr/bin/env bash
# Set up a CPU SGLang environment for genlm-backend's SGLang backend (genlm/backend/llm/sgl/).
#
# Usage: scripts/setup_sglang.sh [VERSION] [ENV_DIR]
#   VERSION: the SGLang release (default 0.5.18; 0.5.12.post1 is also known).
#   ENV_DIR: the virtual environment to create or update (default: .venv-sglang-VERSION in the
#            repository root).
# Environment: PYTHON (a Python 3.11 interpreter, default python3.11), MAX_JOBS (kernel build
#   jobs, default: the number of cores), CUDA_HOME (default /usr/local/cuda), SGLANG_SMOKE_MODEL
#   (the model of the smoke run, default the SmolLM2-135M-Instruct asset of genlm-backend),
#   XDG_CACHE_HOME (where the built kernel wheel is kept).
#
# What it does (see ../shared/sgl/README.md, next to the repository, for the facts behind it):
#   1. checks that the CPU can run the kernels (x86-64 with AVX-512, AVX-512 BF16 and VNNI;
#      AMX is not needed: without it SGLang runs its torch_native attention and torch layers);
#   2. a Python 3.11 virtual environment with SGLang's CPU-side requirements
#      (../shared/sgl/requirements-sglang-VERSION.txt) and scikit-build-core, then the SGLang
#      wheel with --no-deps (its other dependencies are GPU packages);
#   3. SGLang's CPU kernel package, built from ../shared/sgl/sgl-kernel-*-src-*.tar.gz (the
#      registry has no source distribution of it), kept in
#      ${XDG_CACHE_HOME:-$HOME/.cache}/genlm-backend/sgl-kernel/ so that the next run skips the
#      build (about 3 to 8 minutes on 2 cores); needs libnuma-dev (installed with apt-get when
#      running as root) and a CUDA toolkit at CUDA_HOME (CMake looks for one because the
#      registry's torch is a CUDA build);
#   4. this project, editable and with --no-deps (SGLang pins its own torch and transformers),
#      plus its light dependencies that are missing;
#   5. a smoke run of sglang.Engine on the CPU; only when it passes is ENV_DIR/.genlm-sglang-ok
#      written and "sglang VERSION ready: PYTHON" printed.
# A CPU that cannot run the kernels ends with status 0 and a line saying why (no marker file);
# missing sources or build prerequisites, or a failed smoke run, end with status 1.
#
# Idempotent: every step checks what is there first; a second run takes seconds.
# About 6.3 GB per environment. torch comes from the registry's default (CUDA) build: the
# "+cpu" builds make `import sglang` fail (torchvision), so they are ruled out with "==="
# constraints (a find-links folder holding a "+cpu" torch would otherwise be preferred).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHARED="$REPO/../shared/sgl"

case "${1:-}" in
-h | --help)
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
    exit 0
    ;;
esac

VERSION="${1:-0.5.18}"
ENV_DIR="${2:-$REPO/.venv-sglang-$VERSION}"
PYTHON="${PYTHON:-python3.11}"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
KERNEL_CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/genlm-backend/sgl-kernel"
MARKER_NAME=".genlm-sglang-ok"

say() { echo "[setup_sglang] $*"; }
die() {
    echo "[setup_sglang] error: $*" >&2
    exit 1
}
# timed LABEL CMD...: run CMD and print how long it took.
timed() {
    local label="$1" start=$SECONDS
    shift
    "$@"
    say "$label: $((SECONDS - start)) s"
}

# --- 1. the CPU ------------------------------------------------------------------------------
# The kernels are compiled with -march=x86-64-v4 -mavx512bf16 -mavx512vnni (and -mamx-*, though
# the sources use no AMX instruction: their AMX paths go through torch's oneDNN brgemm, which
# picks the instructions at run time).
cpu_model="$(grep -m1 '^model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//')"
cpu_model="${cpu_model:-unknown CPU}"
if [[ "$(uname -m)" != "x86_64" ]]; then
    say "sglang $VERSION not set up: this script builds SGLang's CPU kernels for x86-64 only" \
        "(this machine: $(uname -m), $cpu_model)."
    exit 0
fi
cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2-) "
missing_flags=()
for flag in avx2 fma f16c bmi2 movbe avx512f avx512bw avx512cd avx512dq avx512vl avx512_bf16 \
    avx512_vnni; do
    [[ "$cpu_flags" == *" $flag "* ]] || missing_flags+=("$flag")
done
if ((${#missing_flags[@]})); then
    rm -f "$ENV_DIR/$MARKER_NAME"
    say "sglang $VERSION not set up: SGLang's CPU kernels need x86-64-v4 with AVX-512 BF16" \
        "and VNNI; this CPU ($cpu_model) lacks: ${missing_flags[*]}."
    exit 0
fi
if [[ "$cpu_flags" == *" amx_bf16 "* && "$cpu_flags" == *" amx_tile "* ]]; then
    has_amx=1
    attention_backend=intel_amx
else
    has_amx=0
    attention_backend=torch_native # what SGLang falls back to for intel_amx without AMX
fi
say "CPU: $cpu_model (AMX: $([[ $has_amx == 1 ]] && echo yes || echo no))"

# --- sources ---------------------------------------------------------------------------------
[[ -d "$SHARED" ]] || die "no SGLang sources: $SHARED is missing (it should hold the kernel" \
    "tarballs and requirement files, see its README.md)"
case "$VERSION" in
0.5.18) kernel_glob="sgl-kernel-0.4.6.post1-src-*.tar.gz" ;;
0.5.12.post1) kernel_glob="sgl-kernel-0.4.2.post2-src-*.tar.gz" ;;
*) die "no CPU kernel sources are known for SGLang $VERSION (known: 0.5.18, 0.5.12.post1;" \
    "0.5.20 and later need kernel operations these sources lack)" ;;
esac
requirements="$SHARED/requirements-sglang-$VERSION.txt"
[[ -f "$requirements" ]] || die "missing $requirements"
tarballs=("$SHARED"/$kernel_glob)
[[ -f "${tarballs[0]}" ]] || die "missing the kernel sources for SGLang $VERSION:" \
    "$SHARED/$kernel_glob"
tarball="${tarballs[0]}"
tarball_name="$(basename "$tarball" .tar.gz)"
kernel_top="$(tar tzf "$tarball" | awk -F/ 'NR == 1 {print $1}')"
kernel_version="$(tar xzOf "$tarball" "$kernel_top/pyproject_cpu.toml" |
    sed -n 's/^version *= *"\(.*\)"/\1/p')"
[[ -n "$kernel_version" ]] || die "no version in $tarball:$kernel_top/pyproject_cpu.toml"

# --- 2. the environment ----------------------------------------------------------------------
STATE="$ENV_DIR/.genlm-setup"
PY="$ENV_DIR/bin/python"

if [[ ! -x "$PY" ]]; then
    command -v "$PYTHON" >/dev/null || die "$PYTHON not found (set PYTHON to a Python 3.11)"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' ||
        die "$PYTHON is not Python 3.11 (set PYTHON to one)"
    say "creating $ENV_DIR"
    "$PYTHON" -m venv "$ENV_DIR"
    mkdir -p "$STATE"
    "$PY" -m pip install --quiet --upgrade pip >"$STATE/pip.log" 2>&1 ||
        die "could not upgrade pip in $ENV_DIR (log: $STATE/pip.log)"
fi
mkdir -p "$STATE"
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' ||
    die "$ENV_DIR is not a Python 3.11 environment"

# pip, with the exact pins of the requirements as "===" constraints: "==2.13.0" would also
# accept a local "2.13.0+cpu" build, which pip prefers when a find-links folder offers one.
sed -n 's/^\([A-Za-z0-9_.-]*\)==\([^ ;#]*\).*/\1===\2/p' "$requirements" >"$STATE/constraints.txt"
pip_install() {
    local log="$1"
    shift
    if ! "$PY" -m pip install --constraint "$STATE/constraints.txt" "$@" >"$STATE/$log" 2>&1; then
        tail -n 30 "$STATE/$log" >&2
        die "pip install $* failed (log: $STATE/$log)"
    fi
}
# dist_version NAME: the installed version of distribution NAME (empty if none).
dist_version() {
    "$PY" - "$1" <<'EOF'
import sys
from importlib import metadata
try:
    print(metadata.version(sys.argv[1]))
except metadata.PackageNotFoundError:
    print("")
EOF
}

requirements_stamp="$(cat "$requirements" <(echo scikit-build-core) | sha256sum | cut -c1-64)"
if [[ "$(cat "$STATE/requirements.sha256" 2>/dev/null)" != "$requirements_stamp" ]]; then
    say "installing SGLang's CPU-side requirements (about 4 GB)"
    timed "requirements" pip_install requirements.log -r "$requirements" scikit-build-core
    echo "$requirements_stamp" >"$STATE/requirements.sha256"
fi
if [[ "$(dist_version sglang)" != "$VERSION" ]]; then
    timed "sglang $VERSION" pip_install sglang.log --no-deps "sglang==$VERSION"
fi

# --- 3. the kernel ---------------------------------------------------------------------------
torch_version="$(dist_version torch)"
py_tag="$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
wheel_dir="$KERNEL_CACHE/$tarball_name/torch-$torch_version-$py_tag"
wheel="$(ls "$wheel_dir"/sglang_kernel_cpu-*.whl 2>/dev/null | head -1 || true)"

build_kernel() {
    if [[ ! -f /usr/include/numa.h ]]; then
        if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
            timed "apt-get install libnuma-dev" bash -c \
                'apt-get update -qq && apt-get install -y -qq libnuma-dev >/dev/null'
        else
            die "the kernel build needs libnuma's headers: sudo apt-get install -y libnuma-dev"
        fi
    fi
    [[ -x "$CUDA_HOME/bin/nvcc" && -f "$CUDA_HOME/include/cuda_runtime.h" ]] ||
        die "the kernel build needs a CUDA toolkit at CUDA_HOME=$CUDA_HOME (CMake looks for one" \
            "because torch is a CUDA build; no GPU is needed)"
    local cudart nvrtc
    cudart="$(ls "$CUDA_HOME"/lib/libcudart.so "$CUDA_HOME"/lib64/libcudart.so 2>/dev/null |
        head -1 || true)"
    nvrtc="$("$PY" 2>/dev/null <<'EOF' || true
import glob, os
import nvidia
found = [p for d in nvidia.__path__ for p in glob.glob(os.path.join(d, "cu*", "lib", "libnvrtc.so.*"))]
print(sorted(found)[0] if found else "")
EOF
)"
    [[ -n "$cudart" ]] || die "no libcudart.so under $CUDA_HOME/lib or $CUDA_HOME/lib64"
    [[ -n "$nvrtc" ]] || die "no libnvrtc in the environment's nvidia packages (torch's CUDA runtime)"
    if ! command -v cmake >/dev/null && [[ ! -x "$ENV_DIR/bin/cmake" ]]; then
        pip_install cmake.log cmake
    fi

    local work
    work="$(mktemp -d "${TMPDIR:-/tmp}/sgl-kernel-build.XXXXXX")"
    # shellcheck disable=SC2064
    trap "rm -rf '$work'" EXIT
    tar xzf "$tarball" -C "$work"
    cp "$work/$kernel_top/pyproject_cpu.toml" "$work/$kernel_top/pyproject.toml"
    local jobs="${MAX_JOBS:-$(nproc)}"
    say "building sglang-kernel-cpu $kernel_version from $(basename "$tarball")" \
        "($jobs jobs; log: $STATE/kernel-build.log)"
    if ! (cd "$work/$kernel_top" &&
        PATH="$ENV_DIR/bin:$PATH" VIRTUAL_ENV="$ENV_DIR" MAX_JOBS="$jobs" \
            CMAKE_BUILD_PARALLEL_LEVEL="$jobs" \
            "$PY" -m pip wheel -v --no-build-isolation --no-deps . -w "$work/wheel" \
            -C cmake.define.CUDA_TOOLKIT_ROOT_DIR="$CUDA_HOME" \
            -C cmake.define.CUDA_CUDART_LIBRARY="$cudart" \
            -C cmake.define.CUDA_INCLUDE_DIRS="$CUDA_HOME/include" \
            -C cmake.define.CUDA_nvrtc_LIBRARY="$nvrtc") >"$STATE/kernel-build.log" 2>&1; then
        tail -n 30 "$STATE/kernel-build.log" >&2
        die "the kernel build failed (log: $STATE/kernel-build.log)"
    fi
    mkdir -p "$wheel_dir"
    local built
    built="$(ls "$work"/wheel/sglang_kernel_cpu-*.whl)"
    cp "$built" "$wheel_dir/.partial" # the cache only ever holds whole wheels
    mv "$wheel_dir/.partial" "$wheel_dir/$(basename "$built")"
    rm -rf "$work"
    trap - EXIT
    wheel="$wheel_dir/$(basename "$built")"
}

if [[ -z "$wheel" ]]; then
    timed "kernel build" build_kernel
else
    say "kernel wheel from the cache: $wheel"
fi
wheel_sha="$(sha256sum "$wheel" | cut -c1-64)"
if [[ "$(dist_version sglang-kernel-cpu)" != "$kernel_version" ||
    "$(cat "$STATE/kernel.sha256" 2>/dev/null)" != "$wheel_sha" ]]; then
    pip_install kernel-install.log --no-deps --force-reinstall "$wheel"
    echo "$wheel_sha" >"$STATE/kernel.sha256"
fi

# --- 4. this project -------------------------------------------------------------------------
project_installed="$("$PY" - "$REPO" <<'EOF'
import json, sys
from importlib import metadata
from pathlib import Path
try:
    info = json.loads(metadata.distribution("genlm-backend").read_text("direct_url.json") or "{}")
except metadata.PackageNotFoundError:
    info = {}
url = "file://" + str(Path(sys.argv[1]).resolve())
print(int(info.get("url") == url and info.get("dir_info", {}).get("editable", False)))
EOF
)"
if [[ "$project_installed" != 1 ]]; then
    timed "genlm-backend (editable)" pip_install project.log --no-deps -e "$REPO"
fi
# Its dependencies other than torch and transformers (pinned by SGLang; transformers may then be
# older than pyproject.toml asks for): pure Python, whose own dependencies SGLang's bring.
light_missing=()
for dist in accelerate graphviz numpy; do
    [[ -n "$(dist_version "$dist")" ]] || light_missing+=("$dist")
done
if ((${#light_missing[@]})); then
    pip_install light-deps.log --no-deps "${light_missing[@]}"
fi
# What tests/llm/sgl/test_sgl_real.py runs with (scripts/test.sh runs it in this environment).
if [[ -z "$(dist_version pytest-asyncio)" || -z "$(dist_version psutil)" ]]; then
    pip_install test-deps.log pytest pytest-asyncio psutil
fi

# --- 5. the smoke run ------------------------------------------------------------------------
model="${SGLANG_SMOKE_MODEL:-${GENLM_BACKEND_ASSETS:-$HOME/.cache/genlm-backend/assets}/smollm2-135m-instruct}"
signature="sglang=$VERSION kernel=$wheel_sha torch=$torch_version attention=$attention_backend cpu=$cpu_model model=$model"
if [[ -f "$ENV_DIR/$MARKER_NAME" && "$(head -1 "$ENV_DIR/$MARKER_NAME")" == "$signature" ]]; then
    say "smoke run passed before (marker $ENV_DIR/$MARKER_NAME)"
    echo "sglang $VERSION ready: $PY"
    exit 0
fi
rm -f "$ENV_DIR/$MARKER_NAME"
if [[ ! -f "$model/config.json" ]]; then
    say "sglang $VERSION installed but not verified: no smoke-run model at $model" \
        "(run \`$PY -m genlm.backend.assets\`, or set SGLANG_SMOKE_MODEL to a model folder)"
    exit 0
fi

# A file, not stdin: the engine starts its processes with multiprocessing's "spawn".
cat >"$STATE/smoke_engine.py" <<'EOF'
import os
import sys

model, attention_backend = sys.argv[1], sys.argv[2]

if __name__ == "__main__":
    import sglang

    engine = sglang.Engine(
        model_path=model,
        device="cpu",
        attention_backend=attention_backend,
        dtype="bfloat16",
        disable_overlap_schedule=True,
        max_total_tokens=4096,
        log_level="warning",
    )
    try:
        out = engine.generate(
            ["The capital of France is"], {"max_new_tokens": 4, "temperature": 0.0}
        )
        text = out[0]["text"]
        print(f"SMOKE_TEXT {text!r}", flush=True)
        if not text.strip():
            sys.exit("SMOKE_FAIL: empty generation")
        if "smollm2" in os.path.basename(model.rstrip("/")).lower() and "Paris" not in text:
            sys.exit(f"SMOKE_FAIL: SmolLM2 did not say Paris: {text!r}")
    finally:
        engine.shutdown()
    print("SMOKE_OK", flush=True)
EOF
smoke() {
    (cd "${TMPDIR:-/tmp}" && SGLANG_USE_CPU_ENGINE=1 timeout 900 "$PY" "$STATE/smoke_engine.py" \
        "$model" "$attention_backend" >"$STATE/smoke.log" 2>&1)
}
say "smoke run: sglang.Engine(device=cpu, attention_backend=$attention_backend, dtype=bfloat16)"
smoke_start=$SECONDS
smoke_rc=0
smoke || smoke_rc=$?
if [[ $smoke_rc == 0 ]] && grep -q '^SMOKE_OK' "$STATE/smoke.log"; then
    say "smoke run: $((SECONDS - smoke_start)) s, $(grep -m1 '^SMOKE_TEXT' "$STATE/smoke.log")"
    printf '%s\n%s\n' "$signature" "$(date -u +%FT%TZ)" >"$ENV_DIR/$MARKER_NAME"
    echo "sglang $VERSION ready: $PY"
else
    reason="$(grep -E 'SMOKE_FAIL|Error|error:|Illegal instruction|core dumped' "$STATE/smoke.log" |
        grep -v 'Ignore import error' | tail -1 || true)"
    if ((smoke_rc == 124)); then
        reason="timed out after 900 s"
    elif ((smoke_rc == 132)); then
        reason="illegal instruction (SIGILL): the CPU lacks an instruction the kernels use"
    elif ((smoke_rc > 128)); then
        reason="killed by signal $((smoke_rc - 128))${reason:+; $reason}"
    fi
    say "sglang $VERSION installed but its smoke run failed (CPU: $cpu_model):" \
        "${reason:-see the log} (log: $STATE/smoke.log)"
    exit 1
fi
exit 0
