"""Trains a study's tokenizer on a CPU, before a lent accelerator's call needs it.

    python scripts/study_tokenizer.py --config=configs/study/gpu.py:one_call \
        --out=runs/study_tokenizer \
        --config.pretrain.data.sources.large.path=/data/wiki_large \
        --config.pretrain.data.sources.wiki.path=/data/wiki

writes <out>/tokenizer.model, the BPE the study's pretraining config describes, trained on
its corpora as the study itself would (the same sample of config.pretrain.tokenizer.
max_sentences lines, the same seed), and prints its path and SHA-256. Give it to the study
with --config.pretrain.tokenizer.model_path: every call then uses the same pieces and
none spends its minutes training it (benchmarks/gpu_study.sh carries it). A tokenizer
already in <out> is kept (it must have the configured vocabulary size).
"""

from absl import app, flags

from maelm_jax.data import digests, run_data
from maelm_jax.infra import cli, errors, paths
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.study import config as study_config

FLAGS = flags.FLAGS
cli.define_config("configs/study/gpu.py:one_call", "Study config file[:variant], as for "
                  "main.py.", prefix=cli.program())
flags.DEFINE_string("out", None, "The directory to write tokenizer.model into.")
cli.directory_flag("out")


def main(argv):
    del argv  # cli.tool_flags_parser refuses stray arguments
    if not FLAGS.out:
        cli.fail("--out: expected the directory to write tokenizer.model into", cli.program())
    c = FLAGS.config
    try:
        study_config.validate(c)
        shared = pretrain_config.resolve_paths(study_config.model_config(c, "mlm"))
        run_data.validate_sources(shared)
        out = paths.resolve(FLAGS.out, "--out")
        paths.make_dirs(out)
        shared.tokenizer.model_path = ""  # trained here (or the one in --out kept)
        tok = run_data.setup_tokenizer(shared, out)
    except errors.UserError as e:
        cli.fail(cli.one_line(e), cli.program())
    print(f"{tok.model_path} ({tok.vocab_size} pieces) sha256 {digests.sha256_of(tok.model_path)}")


if __name__ == "__main__":
    app.run(main, flags_parser=cli.tool_flags_parser)
