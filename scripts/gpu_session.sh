#!/usr/bin/env bash
# One lent GPU, one call: the exactness check first, then the speed benchmark, inside one time budget.
#
# A session's device time (15 minutes, starts included) fits one call of both scripts at their default sizes only
# when each gets a deadline: scripts/device_check.py takes about 45% of the budget (its 8B rows at 4k and 16k come
# before the chunk costs), bench/bench_gpu.py the rest. Each writes its JSON after every step, so a run cut short
# still returns what it measured. Results land in $OUT (what a device call returns), else bench/results.
#
# On the session's machine, once:   echo /.whl/ >> .git/info/exclude   (also in .gitignore) and
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl platformdirs==4.3.6
# The device call (carry .whl; the image's torch and transformers are inside kvstate's window):
#   KVSTATE_COMMIT=<git rev-parse HEAD> bash scripts/gpu_session.sh 540
# A CPU trial of the same call at small shapes:
#   bash scripts/gpu_session.sh 300 --cpu-trial
set -u
budget=${1:-540}
trial=${2:-}
start=$(date +%s)
here=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$here/bench/results}
mkdir -p "$out"
if compgen -G "$here/.whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$here"/.whl/*.whl || exit 1
fi
export PYTHONPATH="$here/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1 || true

if [ "$trial" = "--cpu-trial" ]; then
  check=(--device cpu --shape small --lengths 96 160 --chunks 16 32 --cost-length 100 --tiny tiny:llama)
  speed=(--device cpu --shape small --streams 1 4 --cost-length 100)
  suffix=_cpu_trial
else
  check=()
  speed=()
  suffix=""
fi

"$python" "$here/scripts/device_check.py" "${check[@]}" --deadline $((budget * 45 / 100)) \
  --out "$out/device_check_cuda$suffix.json" 2>&1 | tee "$out/device_check$suffix.log"
left=$((budget - ($(date +%s) - start) - 15))
if [ "$left" -gt 30 ]; then
  "$python" "$here/bench/bench_gpu.py" "${speed[@]}" --deadline "$left" --out "$out/gpu_speed$suffix.json" 2>&1 \
    | tee "$out/gpu_speed$suffix.log"
else
  echo "no time left for bench_gpu.py ($left s)" | tee "$out/gpu_speed$suffix.log"
fi
echo "gpu_session: $(( $(date +%s) - start )) s of $budget"
