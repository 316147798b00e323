#!/usr/bin/env bash
# Builds (once) the venv of the opt-in SGLang CPU tier: torch 2.13.0 (CPU), gyre (editable),
# SGLang 0.5.23 without its dependencies (they pin a CUDA torch and CUDA kernels, ~10 GB),
# the dependencies that importing sglang.srt.entrypoints.engine and starting an Engine on
# CPU need, and stubs for torchvision and sgl_kernel. An unsupported SGLang setup, used only
# to check gyre's adapter against the real library. Not run by the default test suite.
#
#   tests/sglang_cpu/build_env.sh        # prints "READY <python>" last
#
# Where: ${GYRE_CACHE:-$HOME/.cache/gyre}/sglang-cpu-0.5.23 (~2.5 GB). Idempotent: a marker
# holding this script's hash says the venv is complete; a missing marker or a changed script
# rebuilds it from scratch, and a checkout at another path only re-installs gyre.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${GYRE_CACHE:-$HOME/.cache/gyre}/sglang-cpu-0.5.23"
PYTHON="${PYTHON:-python3}"
MARKER="$VENV/.gyre-complete"
RECIPE="$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)"
# What importing the engine and starting it on CPU needed, found by trying; pinned where
# SGLang 0.5.23 pins (its METADATA), triton at the version tested (SGLang imports it at
# top level everywhere; its pin follows torch 2.14.1, which is not installed here).
SGLANG_DEPS=(
  "transformers==5.19.0" "xgrammar==0.2.7" "apache-tvm-ffi==0.1.11" "compressed-tensors==0.18.0"
  "sentencepiece==0.2.1" "triton==3.9.0" "uvicorn>=0.51" fastapi gguf psutil pybase64 requests
  pillow msgspec ipython dill partial_json_parser setproctitle einops
)

step() { printf '[build_env] %s\n' "$*"; }
die() { printf '[build_env] FAILED: %s\n' "$*" >&2; exit 1; }
pip_q() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
check_torch() {
  local v
  v="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)" || die "torch does not import ($1)"
  [ "$v" = "2.13.0+cpu" ] || die "torch is $v after $1, expected 2.13.0+cpu"
}

write_stub() {  # write_stub NAME: a package whose every attribute and submodule is a stub
  local dir
  dir="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/$1"
  mkdir -p "$dir"
  cat > "$dir/__init__.py" <<EOF
"""Stub of $1 written by gyre's tests/sglang_cpu/build_env.sh: the real package is
CUDA-only. Any submodule imports and any name resolves, but calling one raises, so a
code path that needs the real package fails loudly instead of computing something else."""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"


class Missing:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name} is a stub (gyre's CPU SGLang setup)")

    def __mro_entries__(self, bases):
        return (object,)

    def __repr__(self):
        return f"<stub {self._name}>"


def _getattr_of(module_name):
    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"{module_name}.{attr}")
    return __getattr__


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _getattr_of(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_Submodules())
__getattr__ = _getattr_of(__name__)
EOF
}

install_gyre() {  # install_gyre [PIP_ARGS...]
  step "gyre (editable) from $ROOT"
  pip_q "$@" -e "$ROOT"
  printf '%s\n' "$ROOT" > "$VENV/.gyre-repo"
}

build() {
  local t0=$SECONDS
  step "building $VENV with $("$PYTHON" --version 2>&1)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV" || die "$PYTHON -m venv"
  step "torch==2.13.0 (the CPU build)"
  pip_q torch==2.13.0
  check_torch "installing torch"
  install_gyre
  # torch stays pinned from here on: a dependency that wants another torch fails the build.
  printf 'torch==2.13.0\n' > "$VENV/constraints.txt"
  step "sglang==0.5.23 without dependencies"
  pip_q --no-deps sglang==0.5.23
  step "its dependencies for CPU: ${SGLANG_DEPS[*]}"
  # pip then lists every requirement of SGLang left out (CUDA torch and kernels, ...): on
  # purpose, so those lines are dropped; pipefail still fails the build when pip fails.
  local unmet="^sglang 0\.5\.23 requires |dependency resolver does not currently|source of the following dep"
  pip_q -c "$VENV/constraints.txt" "${SGLANG_DEPS[@]}" 2>&1 | { grep -v -E "$unmet" || true; }
  check_torch "installing SGLang's dependencies"
  step "megatron-core==0.16.1 without dependencies (pure Python: the GPU check's other backend)"
  pip_q --no-deps megatron-core==0.16.1
  step "stubs: torchvision, sgl_kernel"
  write_stub torchvision
  write_stub sgl_kernel
  step "smoke test: import the engine, gyre and its SGLang adapter"
  SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -W ignore -c 'import sglang.srt.entrypoints.engine
import gyre.workerd.engines.sglang, sglang
print("sglang", sglang.__version__, "imports")' || die "the smoke import failed"
  printf '%s\n' "$RECIPE" > "$MARKER"
  step "done in $((SECONDS - t0)) s; $(du -sh "$VENV" | cut -f1) at $VENV"
}

mkdir -p "$(dirname "$VENV")"
exec 9> "$VENV.lock"
flock -w 3600 9 || die "another build holds $VENV.lock"
if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$RECIPE" ]; then
  step "reusing $VENV"
  if [ "$(cat "$VENV/.gyre-repo" 2>/dev/null)" != "$ROOT" ]; then
    install_gyre --no-deps
  fi
else
  [ -f "$MARKER" ] && step "the recipe changed since $VENV was built: rebuilding"
  build
fi
echo "READY $VENV/bin/python"
