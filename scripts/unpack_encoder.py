"""A study call's packed encoder (encoder_<model>.npz, what benchmarks/gpu_study.sh brings
back) made a pretraining workdir again, on any machine.

    python scripts/unpack_encoder.py --file=encoder_maelm.npz --out=runs/maelm_seed0

writes <out>/config.json, tokenizer.model and checkpoints/<step> (the encoder's parameters,
bfloat16 values in float32; maelm_jax/study/encoders.py), which fine-tuning
(--config.init_from), the rank analysis (--config.runs, with a corpus source: the prepared
data are not in the file) and the export take as any pretraining workdir.
"""

from absl import app, flags

from maelm_jax.infra import cli, errors, paths
from maelm_jax.study import encoders

FLAGS = flags.FLAGS
flags.DEFINE_string("file", None, "The packed encoder (.npz).")
flags.DEFINE_string("out", None, "The new workdir to write.")
cli.directory_flag("out")


def main(argv):
    del argv  # cli.tool_flags_parser refuses stray arguments
    for name in ("file", "out"):
        if not getattr(FLAGS, name):
            cli.fail(f"--{name}: required", cli.program())
    file = paths.Path(FLAGS.file)
    if not file.is_file():
        cli.fail(f"--file: {FLAGS.file} does not exist", cli.program())
    try:
        step_dir = encoders.unpack(file, paths.resolve(FLAGS.out, "--out"))
    except errors.UserError as e:
        cli.fail(cli.one_line(e), cli.program())
    print(f"{FLAGS.out}: a pretraining workdir (checkpoint {step_dir})")


if __name__ == "__main__":
    app.run(main, flags_parser=cli.tool_flags_parser)
