#!/usr/bin/env bash
# Launch training on this machine.
#   NGPU=4 ./run_train.sh --parallelism.data_parallel_shard_degree 2 [more --section.field overrides]
# Environment:
#   NGPU       ranks to start (default: number of visible GPUs, else 1)
#   LOG_RANK   ranks whose console output is shown, e.g. 0 or 0,1 (default 0)
#   MODULE     model module (default llama3; or --module on the command line)
#   CONFIG     named config of that module's config_registry (default <module>_debugmodel,
#              e.g. llama3_debugmodel; or --config on the command line)
#   COMM_MODE  empty for real collectives; fake_backend / local_tensor are debugging modes
#   MAX_RESTARTS  restarts of every rank after one dies, each resuming from the last complete
#              checkpoint (default 0; see docs/fault_tolerance.md)
#   PYTHON     interpreter (default: .venv/bin/python if present, else python3)
set -euo pipefail
cd "$(dirname "$0")"

if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [ -z "${NGPU:-}" ]; then
  NGPU=$("$PYTHON" - <<'PY' 2>/dev/null || echo 1
import os, subprocess
try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    print(max(1, sum(line.startswith("GPU") for line in out.splitlines())))
except Exception:
    print(1)
PY
)
fi
if ! "$PYTHON" -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('torch', 'tomli', 'tyro')))" 2>/dev/null; then
  echo "error: $PYTHON lacks torchtitan's dependencies: run 'make setup' first (it makes .venv), or set PYTHON" >&2
  exit 2
fi
if ! [[ "$NGPU" =~ ^[1-9][0-9]*$ ]]; then
  echo "config error: NGPU=$NGPU must be a positive integer (ranks to start)" >&2
  exit 2
fi
MAX_RESTARTS=${MAX_RESTARTS:-0}
if ! [[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]]; then
  echo "config error: MAX_RESTARTS=$MAX_RESTARTS must be a whole number (restarts after a rank dies)" >&2
  exit 2
fi
LOG_RANK=${LOG_RANK:-0}
for r in ${LOG_RANK//,/ }; do
  if ! [[ "$r" =~ ^[0-9]+$ ]] || [ "$r" -ge "$NGPU" ]; then
    echo "config error: LOG_RANK=$LOG_RANK: $r is not a rank of NGPU=$NGPU (0..$((NGPU - 1)), comma-separated)" >&2
    exit 2
  fi
done
# Only what is set: the config manager picks llama3, and <module>_debugmodel for a module
# without a --config (MODULE=qwen3 or --module qwen3 alone trains qwen3_debugmodel).
SELECT=()
if [ -n "${MODULE:-}" ]; then SELECT+=(--module "$MODULE"); fi
if [ -n "${CONFIG:-}" ]; then SELECT+=(--config "$CONFIG"); fi
COMM_MODE=${COMM_MODE:-}
export TITAN_HELP_PROG=./run_train.sh  # what usage lines (--help, a bad value) name

for arg in "$@"; do
  if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then
    exec "$PYTHON" -m torchtitan.config.manager ${SELECT[@]+"${SELECT[@]}"} "$@"
  fi
done

case "$COMM_MODE" in
  "") MODE_ARGS=() ;;
  fake_backend|local_tensor) MODE_ARGS=(--comm.mode "$COMM_MODE") ;;
  *)
    echo "COMM_MODE=$COMM_MODE is not a mode: use fake_backend, local_tensor, or leave it unset" >&2
    exit 2 ;;
esac

# Resolve and validate the config in one light process (no torch import) before starting ranks,
# so a typo gives one clear line instead of one error per rank.
WORLD_SIZE=$NGPU "$PYTHON" -m torchtitan.config.manager --check \
  ${SELECT[@]+"${SELECT[@]}"} ${MODE_ARGS[@]+"${MODE_ARGS[@]}"} "$@"

if [ -n "$COMM_MODE" ]; then
  # One process, no torchrun: fake_backend plays rank $RANK of $NGPU; local_tensor
  # simulates all $NGPU ranks. See docs/debugging.md.
  WORLD_SIZE=$NGPU RANK=${RANK:-0} LOCAL_RANK=0 exec "$PYTHON" -m torchtitan.train \
    ${SELECT[@]+"${SELECT[@]}"} ${MODE_ARGS[@]+"${MODE_ARGS[@]}"} "$@"
fi

# torchrun through torchtitan.launcher: a rank's refusal comes back as its one line and exit
# code, not as torchrun's traceback. Overrides are passed as separate, quoted words.
exec "$PYTHON" -m torchtitan.launcher \
  --nproc_per_node="$NGPU" --max-restarts "$MAX_RESTARTS" \
  --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m torchtitan.train ${SELECT[@]+"${SELECT[@]}"} "$@"
