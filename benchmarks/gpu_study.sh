#!/usr/bin/env bash
# One call of the study on a lent GPU machine: the one-call design (configs/study/gpu.py:
# one_call), a seed call (:seeds) or a mechanism call (:mechanism), sized at its start to
# end within MINUTES. Run it from the project root there; it brings back the call's record
# and its pretrained encoders, however the call ends.
#
#   benchmarks/gpu_study.sh OUT_DIR [PRESET [MINUTES [main.py flags ...]]]
#
# PRESET: one_call (default), seeds or mechanism (add --config.pretrain.seed=N, one N per
# call; mechanism pretrains and analyses only, no GLUE) or gpu (the whole study, in several
# calls; the parts merge with configs/study/merge.py).
# MINUTES: main.py's --time_limit_minutes (default 9; a fraction is allowed). The study
# stops itself there (status 75); main.py also runs under `timeout -s TERM` at MINUTES plus
# STUDY_TIMEOUT_MARGIN seconds (default 20), whose SIGTERM takes the study's stop path
# (it writes study.json), and KILL follows STUDY_STOP_GRACE seconds (default 20) later.
# Setup (sourcing .device/setup.sh: the wheels, unpacking the corpora, importing jax) comes
# before both: keep setup + MINUTES + the margin inside the command's 10 minutes, from the
# setup_seconds of the last call.json.
#
# Before the lease, on a CPU (from the project root):
#   python scripts/study_tokenizer.py --config=configs/study/gpu.py:one_call \
#       --out=runs/study_tokenizer \
#       --config.pretrain.data.sources.large.path=../shared/data/wiki_large \
#       --config.pretrain.data.sources.wiki.path=../shared/data/wiki
#   ../shared/device/stage.sh ../shared/data/wiki_large ../shared/data/wiki \
#       ../shared/data/glue runs/study_tokenizer
# then run with `carry: [".device"]`, naming the commit the record is of:
#   MAELM_JAX_COMMIT=<git rev-parse HEAD> benchmarks/gpu_study.sh $OUT one_call 8
# (8 minutes: with the start-up, a 15-minute lease then has about 4 left for the GPU suite).
# The corpora travel compressed (about 38 MB) and the tokenizer trained on the CPU with
# them, so every call uses the same pieces and none spends its minutes training one.
#
# On ANY exit (finished, the time limit, the outer timeout, an error, this script itself
# sent SIGTERM or SIGINT, which it passes on to the study and waits STUDY_STOP_GRACE for)
# a trap writes into OUT_DIR records.tar.gz, the small files in one archive: study.json
# (the record: commit it as benchmarks/results/study/<date>_<preset>_seed<N>_<device>.json),
# study.md, sizing.json and the plots (*.png), the log's last 400 lines (study.log), and
# call.json: {"setup_seconds", "main_seconds", "exit_status", "outcome", "minutes",
# "timeout_seconds", "preset"}; and beside it encoder_<model>.npz, each pretrained encoder
# the study packed (bfloat16 with its config and tokenizer, about 14 MB at 6 x 256;
# maelm_jax/study/encoders.py: `python scripts/unpack_encoder.py --file=F --out=DIR` makes a
# workdir of it). A lent machine brings back 8 files of at most 16 MiB: the archive and up
# to 7 encoders.
# STUDY_WORKDIR (default /tmp/study_<preset>) and STUDY_DATA_DIR (default /tmp/data, where
# setup.sh unpacks) move the two directories; STUDY_TOKENIZER the tokenizer.
#
# Exit status: 0 when the call finished; 75 (the time limit) or 143 (preempted: SIGTERM to
# the study or to this script) when it did not, the record saying what is done; 124 when
# the outer timeout killed it (what the workdir holds is still copied); 1 on an error.
set -uo pipefail
start=$(date +%s.%N)
usage="usage: benchmarks/gpu_study.sh OUT_DIR [PRESET [MINUTES [main.py flags ...]]]"
out=${1:?$usage}
preset=${2:-one_call}
minutes=${3:-9}
shift $(( $# < 3 ? $# : 3 ))
workdir=${STUDY_WORKDIR:-/tmp/study_$preset}
data=${STUDY_DATA_DIR:-/tmp/data}
margin=${STUDY_TIMEOUT_MARGIN:-20}
grace=${STUDY_STOP_GRACE:-20}
mkdir -p "$out" || exit 1
log=$out/study.log
: >> "$log"

# Seconds from $1 to $2 (date +%s.%N), one decimal.
seconds() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
main_start=""
main_end=""
child=""
outcome="an error before main.py started"

bring_back() {
  local status=$1 f
  trap - EXIT TERM INT
  local now
  now=$(date +%s.%N)
  local setup main="null"
  setup=$(seconds "$start" "${main_start:-$now}")
  [ -n "$main_start" ] && main=$(seconds "$main_start" "${main_end:-$now}")
  echo "gpu_study.sh: $outcome (status $status); setup ${setup} s, main.py ${main} s" >> "$log"
  # The small files in one archive, so that the encoders fit in the files that come back.
  local records
  records=$(mktemp -d)
  for f in study.json study.md sizing.json; do
    [ -f "$workdir/$f" ] && cp "$workdir/$f" "$records/"
  done
  for f in "$workdir"/*.png; do
    [ -f "$f" ] && cp "$f" "$records/"
  done
  for f in "$workdir"/encoders/*.npz; do
    [ -f "$f" ] && cp "$f" "$out/encoder_$(basename "$f")"
  done
  # The log can grow long; keep its end.
  tail -n 400 "$log" > "$records/study.log" && rm -f "$log"
  local m=null text=${outcome//\\/\\\\}
  [[ $minutes =~ ^[0-9]+([.][0-9]+)?$ ]] && m=$(awk -v m="$minutes" 'BEGIN { print m + 0 }')
  text=${text//\"/\\\"}
  printf '{"preset": "%s", "minutes": %s, "timeout_seconds": %s, "setup_seconds": %s, %s\n' \
    "$preset" "$m" "${timeout_seconds:-null}" "$setup" \
    "$(printf '"main_seconds": %s, "exit_status": %d, "outcome": "%s"}' "$main" "$status" "$text")" \
    > "$records/call.json"
  tar -czf "$out/records.tar.gz" -C "$records" . && rm -rf "$records"
  exit "$status"
}
trap 'bring_back $?' EXIT

# This script told to stop (the lease ending, a Ctrl-C): the study is told too, and given
# STUDY_STOP_GRACE seconds to write its record before the trap copies what there is.
stop() {
  outcome="preempted ($1 to gpu_study.sh)"
  if [ -n "$child" ]; then
    kill -s TERM "$child" 2>/dev/null
    local waited=0
    while kill -0 "$child" 2>/dev/null && [ "$waited" -lt $(( grace * 5 )) ]; do
      sleep 0.2
      waited=$(( waited + 1 ))
    done
    main_end=$(date +%s.%N)
  fi
  exit 143
}
trap 'stop SIGTERM' TERM
trap 'stop SIGINT' INT

fail() { echo "gpu_study.sh: $*" | tee -a "$log" >&2; outcome="error: $*"; exit 1; }

if ! [[ $minutes =~ ^[0-9]+([.][0-9]+)?$ ]]; then
  fail "MINUTES must be a number of minutes, not '$minutes' ($usage)"
fi
if [ ! -f .device/setup.sh ]; then
  fail ".device/ is not staged: run ../shared/device/stage.sh with the wiki_large, wiki" \
       "and glue folders (and the tokenizer's), and carry .device"
fi
. .device/setup.sh >> "$log" 2>&1
for d in wiki_large wiki glue; do
  [ -d "$data/$d" ] || fail "$data/$d is missing: stage.sh it with the others"
done
glue=(--config.glue_dir="$data/glue")
[ "$preset" = mechanism ] && glue=()  # pretraining and the rank analysis only
tokenizer=${STUDY_TOKENIZER:-$data/study_tokenizer/tokenizer.model}
flags=()
if [ -f "$tokenizer" ]; then
  flags=(--config.pretrain.tokenizer.model_path="$tokenizer")
elif [ "$preset" != gpu ]; then
  fail "no tokenizer at $tokenizer: train it on a CPU with scripts/study_tokenizer.py and" \
       "stage its folder (or set STUDY_TOKENIZER)"
fi
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxcache}

timeout_seconds=$(awk -v m="$minutes" -v s="$margin" 'BEGIN { printf "%.1f", 60 * m + s }')
outcome="main.py did not end"
main_start=$(date +%s.%N)
# In the background, so that a signal to this script is handled at once (bash runs a trap
# only after the foreground command ends).
timeout -k "$grace" -s TERM "$timeout_seconds" \
  python3 main.py --config=configs/study/gpu.py:"$preset" --workdir="$workdir" \
  --time_limit_minutes="$minutes" "${flags[@]}" \
  --config.pretrain.data.sources.large.path="$data/wiki_large" \
  --config.pretrain.data.sources.wiki.path="$data/wiki" \
  "${glue[@]}" "$@" >> "$log" 2>&1 &
child=$!
wait "$child"
status=$?
main_end=$(date +%s.%N)

case $status in
  0) outcome="the call finished; its record is study.json in $out/records.tar.gz" ;;
  75) outcome="not finished (the time limit); study.json says what is done" ;;
  143) outcome="preempted (SIGTERM); study.json says what is done" ;;
  124|137) outcome="killed by the outer timeout (${timeout_seconds} s); what it wrote is copied"
     status=124 ;;
  *) outcome="failed with status $status"
     echo "gpu_study.sh: $outcome; the end of $log:" >&2
     tail -n 5 "$log" >&2
     status=1 ;;
esac
echo "gpu_study.sh: $outcome"
exit "$status"
