#!/bin/bash
# dynspec-patch on an air-gapped GPU host: install the carried parts, then run servers + clients.
#
#   bash run.sh install PARTDIR     install one part (partA first: it starts a fresh site)
#   bash run.sh setup               model configs (8b dummy) + crafted 1b weights, JIT warm-up,
#                                   the patched overlay (this checkout's dynspec-patch applied to
#                                   a copy of the installed sglang package)
#   bash run.sh session VARIANT...  run each variant not yet run (server, client, stop) while
#                                   DEADLINE seconds (default 540) since the call's start allow;
#                                   then gather every result so far into $OUT
#
# Variants (THRESHOLD T, default 16):
#   base | base-v1 | eagle-v2 | dyn-v2 | dyn-v2-eager | eagle-v1 | dyn-v1 | dyn-v1-eager | native-v2
#       speed sweep, Llama-3.1-8B shape, random (dummy) weights; *-v1: --disable-overlap-schedule
#       (base-v1: plain decoding under v1's scheduler, v1's like-for-like baseline);
#       dyn-*: patched overlay + --speculative-disable-batch-threshold T (STEP_PROFILE=N:
#       DYNSPEC_PROFILE=N, the per-phase breakdown every N fallback steps, whose CUDA events cost
#       0.3-0.8 % of throughput at c >= 64 on an H200, 2026-12-04: off unless asked for);
#       *-eager: DYNSPEC_DECODE_GRAPHS=0 (the fallback's target forward runs eagerly, as before);
#       dyn-v2-writeN: DYNSPEC_DRAFT_KV_WRITE_STEPS=N (N fallback steps' draft KV writes as one);
#       *-kvprefill: DYNSPEC_DRAFT_PREFILL_WRITE=1 (a prefill in fallback stores the draft KV
#       only; the default on 0.5.17, where VARIANT_ENV=DYNSPEC_DRAFT_PREFILL_WRITE=0 gives the
#       server without it); the two combine: dyn-v2-write8-kvprefill;
#       native-v2 (0.5.14+): pristine tree + the flags `dynspec-patch apply --route native` gives
#       (SGLang's own --speculative-adaptive with a steps-0 config above T)
#   check-base | check-eagle-v2 | check-dyn-v2 | check-dyn-v1                  greedy checks on
#       the crafted 1b successor models (crafted.py) with the strict KV-leak check on
#   env-base | env-eagle | env-fixed-T<N> | env-auto      the envelope (issue 16, envelope.py) on
#       the crafted ENV_SIZE (8b) models: plain, unpatched EAGLE-3, patched overlay with T = N,
#       patched overlay with `auto`; needs `bash run.sh setup-env` (writes the crafted weights)
#       once after setup. ENV_LEVELS (1,4,16,32,64,128), REGIONS (accept0,accept50,accept90,mix;
#       env-base: BASE_REGIONS, accept90), ENV_DURATION (5), ENV_REPEATS (1), OLEN (128),
#       ENV_BURST (env-auto: 1,64,1 run back to back after the sweep; empty: none),
#       ENV_SEED (0: the client's draws; another integer, other prompts and lengths, the same
#       on every server given it: one sample of the traffic otherwise recurs on each),
#       OLEN_SPREAD (0: every request OLEN tokens; s: OLEN * (1 +- s), the same on every server;
#       the speed sweep's closed loops take it too: requests that never run in step)
#       (envelope.py empties the radix cache before each level: every server meets every level
#       in the same state)
#   VARIANT@N (any variant): another server of VARIANT, run where it stands in the list (e.g.
#       env-auto env-base env-auto@2 env-base@2: alternating servers, whose spread
#       envelope_report.py shows); its results and log are named VARIANT@N
#
# Environment: KIT_HOME (/root/dynspec-gpu-kit), PY (python3), OUT, LEVELS (1,16,64,128),
#   DURATION (10: each level is a closed loop of c clients for >= 10 s; 0: one wave of c requests),
#   REPEATS (2: each level twice), OLENS (unset; e.g. 128,512: every level at each output length,
#   whose one-wave levels benchmarks/gpu/wave_fit.py splits into prefill and decode time),
#   WAVES (unset; e.g. 128,512: after the sweep, one-wave levels at these output lengths, at
#   WAVE_LEVELS (64), WAVE_REPEATS (3) times each, into VARIANT-waves[@N]: wave_fit.py's input,
#   from the same server as the sweep), THRESHOLD (16), PORT (31000), HEALTH_TIMEOUT (300),
#   DEADLINE (540), VARIANT_ENV (extra NAME=VALUE words for every dyn-* server, e.g.
#   "DYNSPEC_WARMUP=0"), PROFILE_AT (unset; a concurrency: after the sweep, profile_steps.py records a GPU trace of 30 steps at that load
#   and writes VARIANT.profile.json: GPU busy vs wall time per step, top kernels), PROFILE_ARGS
#   (more profile_steps.py options, e.g. "--olen 2048 --settle 8": 30 steady decode steps;
#   "--wave 64": one wave of PROFILE_AT requests of 64 tokens on the idle server, prefill and
#   decode phases and the GPU's idle gaps, the same work on every server; "--olen 128
#   --olen-spread 0.5 --steps 150": mixed lengths, a prefill every few steps, and what the
#   intervals that hold one add beyond a decode step, in wall, GPU busy and idle time),
#   JITWARM_SKIP (setup: kernels jitwarm.py leaves to the server, e.g. clamp_position),
#   DRAFT_VOCAB (unset: the 8b draft shares the target's 128256-token head; 32000: a 32000-token
#   head as real EAGLE-3 drafts for Llama 3.1 have; results are then named VARIANT-dv32000),
#   TP (1; 2: every server runs --tp-size 2 on the machine's first two GPUs, and its results and
#   log are named KIND-tp2[@N], a kind of its own; with VARIANT_ENV=
#   DYNSPEC_DECODE_GRAPHS_FAIL_ON_RANKS=1, rank 1 loses the fallback's DECODE graphs after their
#   capture, and both ranks must then run the target eagerly: issue 17).
set -u
CALL_START=$(date +%s)
KIT_HOME=${KIT_HOME:-/root/dynspec-gpu-kit}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../../../.." && pwd)          # this checkout: its dynspec-patch is applied
mkdir -p "$KIT_HOME"/{site,work/results,work/logs,models}
SITE=$KIT_HOME/site; WORK=$KIT_HOME/work; RES=$WORK/results; LOGS=$WORK/logs; M=$KIT_HOME/models
DYN=$KIT_HOME/dyn                              # holds the patched copy of sglang/
PY=${PY:-python3}; OUT=${OUT:-$WORK/out}; mkdir -p "$OUT"
T=${THRESHOLD:-16}; PORT=${PORT:-31000}; LEVELS=${LEVELS:-1,16,64,128}
DURATION=${DURATION:-10}; REPEATS=${REPEATS:-2}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export TVM_FFI_CACHE_DIR=$WORK/tvmffi TRITON_CACHE_DIR=$WORK/triton TVM_FFI_CUDA_ARCH_LIST=9.0
export PATH="$(dirname "$(command -v "$PY")"):$PATH"
if ! ldconfig -p 2>/dev/null | grep -q 'libnuma.so.1 '; then
  export LD_LIBRARY_PATH="$SITE/_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
for c in ${CUDA_HOME:-} /usr/local/cuda /usr/local/cuda-13.0; do
  [ -n "$c" ] && [ -x "$c/bin/nvcc" ] && { export CUDA_HOME=$c PATH="$c/bin:$PATH"; break; }
done

dynspec() {   # this checkout's CLI (its directories under the one import name), carried libcst
  local src=$KIT_HOME/dynspec-src/dynspec_patch
  mkdir -p "$src" && for d in patcher transforms fixtures; do ln -sfn "$REPO/$d" "$src/$d"; done
  PYTHONPATH="$KIT_HOME/dynspec-src:$KIT_HOME/deps" PYTHONDONTWRITEBYTECODE=1 "$PY" - "$@" <<'EOF'
import sys
sys.argv[0] = "dynspec-patch"
from dynspec_patch.patcher.cli import main
main()
EOF
}

env_args() {   # the envelope client's options for variant $1 (plain decoding: one region)
  local regions=${REGIONS:-accept0,accept50,accept90,mix}
  local burst=""
  case "$1" in env-base) regions=${BASE_REGIONS:-accept90};; env-auto) burst=${ENV_BURST-1,64,1};; esac
  echo --levels "${ENV_LEVELS:-1,4,16,32,64,128}" --regions "$regions" \
    --duration "${ENV_DURATION:-5}" --repeats "${ENV_REPEATS:-1}" --olen "${OLEN:-128}" \
    --olen-spread "${OLEN_SPREAD:-0}" ${ENV_SEED:+--seed "$ENV_SEED"} \
    ${burst:+--burst "$burst"}
}

phase=${1:-}; shift || true
case "$phase" in
install)
  P=$1
  case "$(basename "$P")" in partA) rm -rf "$SITE"; mkdir -p "$SITE";; esac
  t=$(date +%s); bash "$HERE/install.sh" "$P" "$SITE" "$PY" || exit 1
  if ls "$P"/../wheels/*.whl >/dev/null 2>&1; then   # libcst for the CLI
    mkdir -p "$KIT_HOME/deps"; for w in "$P"/../wheels/*.whl; do "$PY" -m zipfile -e "$w" "$KIT_HOME/deps"; done
  fi
  echo "install $(basename "$P") done in $(( $(date +%s)-t ))s; site $(du -sh "$SITE" | cut -f1)"
  ;;
setup)
  t=$(date +%s)
  "$PY" "$HERE/mkmodels.py" "$M" 8b >/dev/null
  "$PY" "$HERE/mkmodels.py" "$M" 8b 32000 >/dev/null
  [ -n "${SKIP_CRAFTED:-}" ] || PYTHONPATH=$SITE "$PY" "$HERE/mkweights.py" "$M" 1b || exit 1
  PYTHONPATH=$SITE timeout 300 "$PY" "$HERE/jitwarm.py" 8b > "$LOGS/jitwarm.log" 2>&1; echo "jitwarm rc=$?"
  grep -E "^(OK|ERR) |jit warm total" "$LOGS/jitwarm.log" | cut -c1-200
  if grep -q "^ERR activation" "$LOGS/jitwarm.log"; then touch "$WORK/act_fallback"; echo "activation JIT fallback on"; fi
  rm -rf "$DYN"; mkdir -p "$DYN"; cp -a "$SITE/sglang" "$DYN/sglang"
  dynspec apply --sglang-root "$DYN/sglang" --threshold "$T" --worker both --json > "$WORK/apply.json" 2> "$LOGS/apply.err"
  echo "dynspec-patch apply rc=$?: $(head -c 600 "$WORK/apply.json")"; tail -3 "$LOGS/apply.err"
  # the native route's flags (0.5.14+: SGLang's own adaptive), for native-v2; nothing is patched
  rm -rf "$KIT_HOME/native"; mkdir -p "$KIT_HOME/native"; cp -a "$SITE/sglang" "$KIT_HOME/native/sglang"
  dynspec apply --route native --sglang-root "$KIT_HOME/native/sglang" --threshold "$T" --json \
    > "$WORK/native.json" 2>> "$LOGS/apply.err"
  echo "native route rc=$?: $(head -c 400 "$WORK/native.json")"
  dynspec probe --sglang-root "$DYN/sglang" 2>&1 | tail -4
  PYTHONPATH=$SITE "$PY" -c "import torch, sgl_kernel; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
  echo "setup done in $(( $(date +%s)-t ))s"
  ;;
setup-env)   # the crafted ENV_SIZE (8b: ~16 GB) successor target + EAGLE-3 draft
  PYTHONPATH=$SITE "$PY" "$HERE/mkweights.py" "$M" "${ENV_SIZE:-8b}" || exit 1
  ;;
session)
  hook=""; [ -f "$WORK/act_fallback" ] && { hook="$HERE/hook:"; export KIT_ACT_FALLBACK=1; }
  for VARIANT in "$@"; do
    KIND=${VARIANT%@*}   # env-auto@2: a second server of env-auto, its results named env-auto@2
    tp=${TP:-1}; [ "$tp" = 1 ] && tp=""
    V=$KIND${tp:+-tp$tp}${VARIANT#"$KIND"}${DRAFT_VOCAB:+-dv$DRAFT_VOCAB}
    [ -f "$RES/$V.json" ] && { echo "[$V] already done"; continue; }
    left=$(( ${DEADLINE:-540} - ($(date +%s) - CALL_START) ))
    # a check server took 84-108 s to be ready and its check 100 s on an H100 (2026-12-05)
    need=230; case "$V" in check-*) need=220;;
      env-*) est=$("$PY" "$HERE/envelope.py" - - - $(env_args "$KIND") --estimate) || continue
             need=$(( 130 + est ));; esac
    [ "$left" -lt "$need" ] && { echo "[$V] deferred: ${left}s left in this call"; continue; }
    path="$hook$SITE"; envs=(); size=8b
    flags=(--load-format dummy --skip-tokenizer-init --attention-backend triton --sampling-backend pytorch
           --grammar-backend none --mem-fraction-static 0.8 --max-running-requests 128 --cuda-graph-max-bs 128
           --host 127.0.0.1 --port "$PORT" ${tp:+--tp-size "$tp"})
    model=$M/llama-8b; draft=$M/eagle3-8b${DRAFT_VOCAB:+-dv$DRAFT_VOCAB}
    case "$V" in check-*) model=$M/succ-1b; draft=$M/succ-eagle3-1b; flags=("${flags[@]:2}")
                          envs+=(SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY=1);;
      env-*) model=$M/succ-${ENV_SIZE:-8b}; draft=$M/succ-eagle3-${ENV_SIZE:-8b}; flags=("${flags[@]:2}");; esac
    spec=(--speculative-algorithm EAGLE3 --speculative-draft-model-path "$draft" --speculative-num-steps 3
          --speculative-eagle-topk 1 --speculative-num-draft-tokens 4)
    case "$KIND" in
      base|check-base) spec=();;
      base-v1) spec=(--disable-overlap-schedule);;
      eagle-v2|check-eagle-v2) ;;
      eagle-v1) spec+=(--disable-overlap-schedule);;
      native-v2)
        mapfile -t nflags < <("$PY" -c 'import json,sys; [print(f) for f in json.load(open(sys.argv[1])).get("server_flags") or []]' "$WORK/native.json")
        [ ${#nflags[@]} -gt 0 ] || { echo "[$V] no native flags in $WORK/native.json"; continue; }
        spec+=("${nflags[@]}");;
      *dyn-v2*|*dyn-v1*)
        path="$hook$DYN:$SITE"; spec+=(--speculative-disable-batch-threshold "$T")
        [ -n "${STEP_PROFILE:-}" ] && envs+=(DYNSPEC_PROFILE="$STEP_PROFILE")
        [ -n "${VARIANT_ENV:-}" ] && envs+=(${VARIANT_ENV})
        case "$V" in *v1*) spec+=(--disable-overlap-schedule);; esac
        case "$KIND" in *eager) envs+=(DYNSPEC_DECODE_GRAPHS=0);; esac
        case "$KIND" in *-write[0-9]*) n=${KIND##*-write}
          envs+=(DYNSPEC_DRAFT_KV_WRITE_STEPS="${n%%[!0-9]*}");; esac
        case "$KIND" in *-kvprefill*) envs+=(DYNSPEC_DRAFT_PREFILL_WRITE=1);; esac;;
      env-base) spec=();;
      env-eagle) ;;
      env-fixed-T*|env-auto)
        t=${KIND#env-fixed-T}; [ "$KIND" = env-auto ] && t=auto
        path="$hook$DYN:$SITE"; spec+=(--speculative-disable-batch-threshold "$t")
        [ -n "${VARIANT_ENV:-}" ] && envs+=(${VARIANT_ENV});;
      *) echo "unknown variant $V"; continue;;
    esac
    LOG=$LOGS/$V.server.log; t0=$(date +%s)
    echo "[$V] $(date -u +%T) flags: ${spec[*]} env: ${envs[*]:-}" | tee "$LOG"
    # the host as the server meets it: v1 is host-bound, and its first server on a machine ran
    # slower at every step than a second one twice (RESULTS.md, 2026-12-05 third hold)
    { echo "[$V] host load: $(cat /proc/loadavg 2>/dev/null)"
      ps -eo pid,pcpu,rss,etimes,comm --sort=-pcpu 2>/dev/null | head -6 | sed "s/^/[$V] host: /"
    } >> "$LOG"
    env "${envs[@]}" PYTHONPATH="$path" setsid "$PY" -m sglang.launch_server --model-path "$model" "${flags[@]}" \
      "${spec[@]}" >> "$LOG" 2>&1 < /dev/null &
    SRV=$!; ok=0
    while [ $(( $(date +%s)-t0 )) -lt "${HEALTH_TIMEOUT:-300}" ]; do
      kill -0 "$SRV" 2>/dev/null || { echo "[$V] server exited"; break; }
      "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null && { ok=1; break; }
      sleep 1
    done
    echo "[$V] ready=$ok after $(( $(date +%s)-t0 ))s"
    if [ $ok = 1 ]; then
      budget=$(( ${DEADLINE:-540} - ($(date +%s) - CALL_START) - 25 ))
      [ "$budget" -lt 30 ] && budget=0 && echo "[$V] no time left for its client: deferred"
      case "$budget:$V" in
        0:*) ;;
        *:check-*) timeout "$budget" "$PY" "$HERE/check.py" "http://127.0.0.1:$PORT" "$RES/$V.json" "$V";;
        *:env-*) timeout "$budget" "$PY" "$HERE/envelope.py" "http://127.0.0.1:$PORT" "$RES/$V.json" "$V" $(env_args "$KIND");;
        *) timeout "$budget" "$PY" "$HERE/client.py" "http://127.0.0.1:$PORT" "$RES/$V.json" "$V" \
             --levels "$LEVELS" --greedy 4 --min-reqs 4 --mult 1 --duration "$DURATION" --repeats "$REPEATS" \
             --olen-spread "${OLEN_SPREAD:-0}" ${OLENS:+--olens "$OLENS"};;
      esac
      echo "[$V] client rc=$?"
      if [ -n "${WAVES:-}" ] && [ "$budget" -gt 0 ]; then   # one-wave levels at these output lengths (wave_fit.py)
        case "$V" in check-*|env-*) ;; *)
          k=${V%%@*}; wv="$k-waves${V#"$k"}"   # dyn-v2@2 -> dyn-v2-waves@2: pools as a kind
          budget=$(( ${DEADLINE:-540} - ($(date +%s) - CALL_START) - 25 ))
          timeout "$budget" "$PY" "$HERE/client.py" "http://127.0.0.1:$PORT" "$RES/$wv.json" "$wv" \
            --levels "${WAVE_LEVELS:-64}" --greedy 0 --min-reqs 1 --mult 1 --duration 0 \
            --repeats "${WAVE_REPEATS:-3}" --olens "$WAVES"
          echo "[$V] waves rc=$?";;
        esac
      fi
      if [ -n "${PROFILE_AT:-}" ] && [ "$budget" -gt 0 ]; then   # where a loaded step's time goes (torch profiler, GPU only)
        case "$V" in check-*) ;; *)
          timeout 120 "$PY" "$HERE/profile_steps.py" "http://127.0.0.1:$PORT" "$RES" "$V" \
            --concurrency "$PROFILE_AT" --trace-root "$WORK/profiles" ${PROFILE_ARGS:-};;
        esac
      fi
    else
      tail -40 "$LOG"
      echo "{\"name\": \"$V\", \"error\": \"server not ready\"}" > "$RES/$V.json"
    fi
    kill -TERM -- -"$SRV" 2>/dev/null
    for _ in $(seq 1 20); do kill -0 "$SRV" 2>/dev/null || break; sleep 1; done
    kill -KILL -- -"$SRV" 2>/dev/null; sleep 1
    for _ in $(seq 1 20); do
      u=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | sort -n | tail -1)
      { [ -z "$u" ] || [ "$u" -lt 2000 ]; } && break; sleep 1
    done
    echo "[$V] done in $(( $(date +%s)-t0 ))s; dynspec lines:"
    grep -E '\[dynspec\]' "$LOG" | grep -v ' profile ' | head -4
    grep -E '\[dynspec\] profile' "$LOG" | tail -3 | cut -c1-400
    grep -iE 'Traceback|Error|leak' "$LOG" | grep -vE 'FA3|openai_harmony' | head -5 | cut -c1-300
  done
  # everything so far, in at most 3 files
  "$PY" - "$RES" "$OUT/results.json" <<'EOF'
import json, os, sys
res = {}
for f in sorted(os.listdir(sys.argv[1])):
    if f.endswith(".json"):
        res[f[:-5]] = json.load(open(os.path.join(sys.argv[1], f)))
json.dump(res, open(sys.argv[2], "w"))
print("results:", ", ".join(f"{k}{' (error)' if v.get('error') else ''}" for k, v in res.items()))
EOF
  for f in "$LOGS"/*.server.log; do
    echo "=== $(basename "$f")"; grep -E '\[dynspec\]|Traceback|Error|leak|cuda graph|Capture|KV Cache|max_total_num_tokens' "$f" | grep -vE 'FA3|openai_harmony' | head -80
  done > "$OUT/excerpts.txt" 2>&1
  tar czf "$OUT/server-logs.tgz" -C "$LOGS" . 2>/dev/null
  ;;
*) sed -n 2,27p "$0"; exit 2;;
esac
