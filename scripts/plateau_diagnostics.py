"""Why a small run sits on the unigram plateau: the evidence, printed as it trains.

    python scripts/plateau_diagnostics.py --config=tests/tiny_config.py --workdir=runs/diag \
        --steps=1000 --every=250 --config.model.decoder.rel_pos_buckets=32

Prepares the tokenizer and blocks like main.py (in --workdir), trains --steps steps of
the config's own train step (its learning-rate schedule stretched to --steps), and every
--every steps prints, on fixed validation blocks:

* eval loss and masked-token accuracy;
* the gradient norm of each top-level module (encoder layers, decoder, LM head, tables):
  in MAE-LM the encoder only learns through the decoder's attention;
* how much attention the predicted positions pay to their two neighbours, per layer and
  head, in the stack that predicts them (the decoder for MAE-LM, the encoder for MLM),
  against the uniform share 2 / L;
* the decoder's input norm at [MASK] and at kept positions (before its LayerNorm);
* how much of the word-embedding table one direction holds (the tied output layer's
  unigram fit makes the table nearly rank one early in training).

It is a diagnostic for small configs, not a benchmark: it runs on one device.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from maelm_jax.data import loader, run_data
from maelm_jax.infra import cli, paths, sharding
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import objectives
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.text import masking

FLAGS = flags.FLAGS
cli.define_config(None, "Pretraining config file[:variant].", prefix=cli.program())
flags.DEFINE_string("workdir", None, "Where the tokenizer and blocks are prepared.")
cli.directory_flag("workdir")
flags.DEFINE_integer("steps", 1000, "Train steps.", lower_bound=1)
flags.DEFINE_integer("every", 250, "Print the diagnostics every this many steps.",
                     lower_bound=1)
flags.mark_flags_as_required(["config", "workdir"])


def module_grad_norms(grads) -> dict[str, float]:
    """Global norm per module, three path levels deep (e.g. encoder/stack/layer_0)."""
    squares: dict[str, float] = {}
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        name = "/".join(p.key for p in path[:3])
        squares[name] = squares.get(name, 0.0) + float(jnp.sum(jnp.square(g)))
    return {k: v ** 0.5 for k, v in sorted(squares.items())}


def neighbour_attention(probs: np.ndarray, pred_index: np.ndarray) -> np.ndarray:
    """Mean attention of predicted positions to positions +-1, per head.

    probs [B, heads, L, L]; pred_index [B, k]. Returns [heads].
    """
    B, _, L, _ = probs.shape
    rows = probs[np.arange(B)[:, None], :, pred_index, :]  # [B, k, heads, L]
    mass = 0.0
    for offset in (-1, 1):
        keys = np.clip(pred_index + offset, 0, L - 1)[:, :, None, None]
        mass = mass + np.take_along_axis(rows, np.broadcast_to(keys, rows.shape[:3] + (1,)),
                                         axis=-1)[..., 0]
    return mass.mean(axis=(0, 1))


def report(model, params, tokens, counts, vocab_size, special) -> None:
    batch = masking.apply_mask(jax.random.PRNGKey(3), tokens, counts, vocab_size, special)

    def loss(p):
        logits = model.apply({"params": p}, batch)
        sums = objectives.masked_lm_sums(logits, batch.targets, batch.weights)
        return sums["loss_sum"] / sums["count"]

    norms = module_grad_norms(jax.grad(loss)(params))
    print("  gradient norms: " + ", ".join(f"{k} {v:.2e}" for k, v in norms.items()))
    _, state = model.apply({"params": params}, batch, mutable=["intermediates"])
    inter = state["intermediates"]
    L = tokens.shape[1]
    stack = inter["decoder"].get("stack", inter["decoder"]) if "decoder" in inter else \
        inter["encoder"]["stack"]
    for name in sorted(k for k in stack if k.startswith("layer_")):
        attention = stack[name].get("attention") or stack[name].get("self_attention")
        probs = np.asarray(attention["probs"][0])
        if probs.shape[-1] == L:
            shares = neighbour_attention(probs, np.asarray(batch.pred_index))
            shown = ", ".join(f"{v:.3f}" for v in shares)
            print(f"  {name}: attention of predicted positions to their neighbours, per head "
                  f"{shown} (uniform {2 / L:.3f})")
    if "decoder" in inter and "input" in inter["decoder"]:
        x = np.linalg.norm(np.asarray(inter["decoder"]["input"][0]), axis=-1)
        removed = np.ones_like(x, bool)
        np.put_along_axis(removed, np.asarray(batch.enc_index), False, axis=1)
        print(f"  decoder input norm: [MASK] {x[removed].mean():.3f}, kept "
              f"{x[~removed].mean():.3f}")
    table = np.asarray(params["encoder"]["word_embeddings"]["embedding"])
    energy = np.linalg.svd(table, compute_uv=False) ** 2
    print(f"  word embeddings: top direction holds {energy[0] / energy.sum():.1%}")


def main(argv):
    del argv
    config = FLAGS.config
    config.train.num_steps = FLAGS.steps  # the learning-rate schedule spans this run
    pretrain_config.validate(config)
    workdir = paths.resolve(FLAGS.workdir, "--workdir")
    paths.make_dirs(workdir)
    tok = run_data.setup_tokenizer(config, workdir)
    data = run_data.build_blocks(config, workdir, tok)
    t = config.train
    program = setup_lib.build(config, tok.vocab_size,
                              sharding.make_mesh((1, 1, 1), jax.devices()[:1]),
                              special=tok.special)
    model, counts = program.model, program.counts
    eval_data = [jnp.asarray(b) for b in loader.eval_batches(data, t.batch_size, t.eval_batches)]
    batches = loader.train_batches(data, t.batch_size, config.seed)
    state = program.init()
    for step in range(1, FLAGS.steps + 1):
        state, _ = program.train_step(state, next(batches))
        if step % FLAGS.every == 0 or step == FLAGS.steps:
            totals = np.zeros(3)
            for i, tokens in enumerate(eval_data):
                key = jax.random.fold_in(jax.random.PRNGKey(1), i)
                sums = program.eval_step(state.params, tokens, key)
                totals += [float(sums[k]) for k in ("loss_sum", "correct_sum", "count")]
            print(f"step {step}: eval loss {totals[0] / totals[2]:.3f}, "
                  f"accuracy {totals[1] / totals[2]:.3f}", flush=True)
            report(model, state.params, eval_data[0], counts, tok.vocab_size, tok.special)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.tool_flags_parser)
