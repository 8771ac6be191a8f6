#!/usr/bin/env bash
# One call of the study on a lent GPU machine: the one-call design (configs/study/gpu.py:
# one_call) or a seed call (:seeds), sized at its start to end within MINUTES. Run it from
# the project root there; it brings back the call's record.
#
#   benchmarks/gpu_study.sh OUT_DIR [PRESET [MINUTES [main.py flags ...]]]
#
# PRESET: one_call (default), seeds (add --config.pretrain.seed=N, one N per call) or gpu
# (the whole study, in several calls; the parts merge with configs/study/merge.py).
# MINUTES: the time limit (default 9, inside a command's 10 minutes).
#
# Before the lease, on a CPU (from the project root):
#   python scripts/study_tokenizer.py --config=configs/study/gpu.py:one_call \
#       --out=runs/study_tokenizer \
#       --config.pretrain.data.sources.large.path=../shared/data/wiki_large \
#       --config.pretrain.data.sources.wiki.path=../shared/data/wiki
#   ../shared/device/stage.sh ../shared/data/wiki_large ../shared/data/wiki \
#       ../shared/data/glue runs/study_tokenizer
# then run with `carry: [".device"]`, naming the commit the record is of:
#   MAELM_JAX_COMMIT=<git rev-parse HEAD> benchmarks/gpu_study.sh $OUT one_call 9
# The corpora travel compressed (about 38 MB) and the tokenizer trained on the CPU with
# them, so every call uses the same pieces and none spends its minutes training one.
# OUT_DIR gets study.json (the record: commit it as
# benchmarks/results/study/<date>_<preset>_seed<N>_<device>.json), study.md, sizing.json,
# the plots and the log's end.
# Exit status: 0 when the call finished, 75 (time limit) or 143 (preempted) when it did
# not (the record says what is done), 1 on an error.
set -uo pipefail
out=${1:?usage: benchmarks/gpu_study.sh OUT_DIR [PRESET [MINUTES [main.py flags ...]]]}
preset=${2:-one_call}
minutes=${3:-9}
shift $(( $# < 3 ? $# : 3 ))
workdir=${STUDY_WORKDIR:-/tmp/study_$preset}

if [ ! -f .device/setup.sh ]; then
  echo "gpu_study.sh: .device/ is not staged: run ../shared/device/stage.sh with the" \
       "wiki_large, wiki and glue folders (and the tokenizer's), and carry .device" >&2
  exit 1
fi
. .device/setup.sh
for d in wiki_large wiki glue; do
  if [ ! -d "/tmp/data/$d" ]; then
    echo "gpu_study.sh: /tmp/data/$d is missing: stage.sh it with the others" >&2
    exit 1
  fi
done
tokenizer=${STUDY_TOKENIZER:-/tmp/data/study_tokenizer/tokenizer.model}
flags=()
if [ -f "$tokenizer" ]; then
  flags=(--config.pretrain.tokenizer.model_path="$tokenizer")
elif [ "$preset" != gpu ]; then
  echo "gpu_study.sh: no tokenizer at $tokenizer: train it on a CPU with" \
       "scripts/study_tokenizer.py and stage its folder (or set STUDY_TOKENIZER)" >&2
  exit 1
fi
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxcache}
mkdir -p "$out"

start=$(date +%s)
python3 main.py --config=configs/study/gpu.py:"$preset" --workdir="$workdir" \
  --time_limit_minutes="$minutes" "${flags[@]}" \
  --config.pretrain.data.sources.large.path=/tmp/data/wiki_large \
  --config.pretrain.data.sources.wiki.path=/tmp/data/wiki \
  --config.glue_dir=/tmp/data/glue "$@" > "$out/study.log" 2>&1
status=$?
echo "gpu_study.sh: this call took $(( $(date +%s) - start )) s" | tee -a "$out/study.log"

for f in study.md study.json sizing.json loss_curves.png rank_layers.png glue_medians.png; do
  if [ -f "$workdir/$f" ]; then cp "$workdir/$f" "$out/"; fi
done
# The log can grow long; keep its end.
tail -n 400 "$out/study.log" > "$out/study.log.tail" && mv "$out/study.log.tail" "$out/study.log"
case $status in
  0) echo "gpu_study.sh: the call finished; its record is $out/study.json" ;;
  75) echo "gpu_study.sh: not finished (the time limit); study.json says what is done" ;;
  143) echo "gpu_study.sh: preempted (SIGTERM); study.json says what is done" ;;
  *) echo "gpu_study.sh: failed with status $status; the end of $out/study.log:" >&2
     tail -n 5 "$out/study.log" >&2
     exit 1 ;;
esac
exit $status
