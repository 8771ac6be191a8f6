#!/usr/bin/env bash
# The one-GPU study (configs/study/gpu.py) in slices, each of which fits one command of a
# lent GPU machine (at most 10 minutes): run it from the project root there, again and
# again while the machine stays warm, until it says the study is finished.
#
#   benchmarks/gpu_study.sh OUT_DIR [MINUTES [main.py flags ...]]
#
# Staging first, on the machine that has the data (from the project root):
#   ../shared/device/stage.sh <data>/wiki_large <data>/wiki <data>/glue
# Each call: checks the staged data, runs the study for MINUTES (default 8) in /tmp/study
# (kept between calls on a warm machine; finished parts are reused, an interrupted model
# resumes from its checkpoint), with JAX's compilation cache in /tmp/jaxcache, then copies
# the small results (study.md, study.json, the plots, the tokenizer and the log's last
# lines) to OUT_DIR.
# Exit status: 0 when the study is finished, 75 (time limit) or 143 (preempted) when another
# call is needed (the table holds what is done so far), 1 on an error.
#
# When the whole study does not fit the time one machine is held (a lease shorter than the
# study), run it in parts, a share of the models each, and merge their study.json files
# (maelm_jax/study/merge.py): study.json alone redraws the table and plots, and records
# the digests that make parts of one study (settings, tokenizer, data, GLUE files). E.g.
#   lease 1: benchmarks/gpu_study.sh OUT 9 --config.models=mlm,maelm
#   lease 2: benchmarks/gpu_study.sh OUT 9 --config.models=3ml_self,3ml_cross --config.scratch=False
#   then:    python main.py --config=configs/study/merge.py --workdir=runs/study_gpu \
#              --config.inputs=<lease 1's OUT>,<lease 2's OUT>
# Every part must use the same tokenizer: sentencepiece trains the same one from the same
# corpus with the same version, and the merge checks its SHA-256; to be sure, hand the one
# the first part brought back to the others: stage the folder holding it with the data
# (stage.sh ... <dir with tokenizer.model>) and run with
# STUDY_TOKENIZER=/tmp/data/<that dir's name>/tokenizer.model.
set -uo pipefail
out=${1:?usage: benchmarks/gpu_study.sh OUT_DIR [MINUTES [main.py flags ...]]}
minutes=${2:-8}
shift $(( $# < 2 ? $# : 2 ))
workdir=${STUDY_WORKDIR:-/tmp/study}

if [ ! -f .device/setup.sh ]; then
  echo "gpu_study.sh: .device/ is not staged: run ../shared/device/stage.sh with the" \
       "wiki_large, wiki and glue folders, and carry .device" >&2
  exit 1
fi
. .device/setup.sh
for d in wiki_large wiki glue; do
  if [ ! -d "/tmp/data/$d" ]; then
    echo "gpu_study.sh: /tmp/data/$d is missing: stage.sh it with the others" >&2
    exit 1
  fi
done
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxcache}
mkdir -p "$out"

tokenizer=()
if [ -n "${STUDY_TOKENIZER:-}" ]; then
  [ -f "$STUDY_TOKENIZER" ] || { echo "gpu_study.sh: STUDY_TOKENIZER: no such file: $STUDY_TOKENIZER" >&2; exit 1; }
  tokenizer=(--config.pretrain.tokenizer.model_path="$STUDY_TOKENIZER")
fi

start=$(date +%s)
python3 main.py --config=configs/study/gpu.py --workdir="$workdir" \
  --time_limit_minutes="$minutes" "${tokenizer[@]}" \
  --config.pretrain.data.sources.large.path=/tmp/data/wiki_large \
  --config.pretrain.data.sources.wiki.path=/tmp/data/wiki \
  --config.glue_dir=/tmp/data/glue "$@" > "$out/study.log" 2>&1
status=$?
echo "gpu_study.sh: this call took $(( $(date +%s) - start )) s" | tee -a "$out/study.log"

for f in study.md study.json loss_curves.png rank_layers.png glue_medians.png tokenizer.model; do
  if [ -f "$workdir/$f" ]; then cp "$workdir/$f" "$out/"; fi
done
# The log can grow with every call; keep its end.
tail -n 400 "$out/study.log" > "$out/study.log.tail" && mv "$out/study.log.tail" "$out/study.log"
case $status in
  0) echo "gpu_study.sh: the study is finished; results in $out" ;;
  75) echo "gpu_study.sh: not finished (the time limit); call again to continue" ;;
  143) echo "gpu_study.sh: preempted (SIGTERM); call again to continue" ;;
  *) echo "gpu_study.sh: failed with status $status; the end of $out/study.log:" >&2
     tail -n 5 "$out/study.log" >&2
     exit 1 ;;
esac
exit $status
