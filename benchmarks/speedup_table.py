"""The 3ML paper's speedup column (its Table 3), computed from our presets and FLOPs formulas.

    python benchmarks/speedup_table.py

Each row builds a preset of configs/pretrain/3ml.py, counts the training FLOPs of one
update with maelm_jax/pretrain/flops.py (3ML Appendix D, eqs. 2-4, with the exact token counts our
masking uses) and divides the baseline's count by it: the paper's "speedup" is this ratio
at an equal number of updates. The paper's own figure is printed beside ours.

Three of the five rows agree to the printed two decimals; 3ML_self-50 % and 3ML_cross-40 %
(large) come out 0.01 lower (1.46 and 1.36). The continuous form of the formulas
(n_en = (1 - 0.8 r) n) gives the same, so the gap is in how the paper rounded or counted
those two rows, not in our token counts.
"""

from __future__ import annotations

from benchmarks import REPO_ROOT
from maelm_jax.config import variants
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import setup as setup_lib

PRESETS = REPO_ROOT / "configs" / "pretrain" / "3ml.py"
VOCAB = 50265  # RoBERTa's BPE, which the 3ML models use
# (row label, baseline variant, model variant, the paper's Table 3 speedup)
TABLE3 = (
    ("3ML_self-40% base (vs RoBERTa-base)", "mlm_base", "self_base,mask=0.4", 1.22),
    ("3ML_self-50% base (vs RoBERTa-base)", "mlm_base", "self_base,mask=0.5", 1.28),
    ("3ML_self-40% large (vs 24hBERT)", "mlm_large", "self_large,mask=0.4", 1.34),
    ("3ML_self-50% large (vs 24hBERT)", "mlm_large", "self_large,mask=0.5", 1.47),
    ("3ML_cross-40% large (vs 24hBERT)", "mlm_large", "cross_large,mask=0.4", 1.37),
)


def update_flops(variant: str) -> tuple[int, int]:
    """(training FLOPs of one update, encoder length n_enc) of a 3ml.py variant."""
    config = variants.load(f"{PRESETS}:{variant}")
    return setup_lib.step_flops(config, VOCAB), pretrain_config.mask_counts(config).n_enc


def rows() -> list[tuple[str, float, float, int, int]]:
    """(label, our speedup, the paper's, baseline TFLOPs per update, ours)."""
    out = []
    for label, baseline, model, paper in TABLE3:
        base_flops, _ = update_flops(baseline)
        model_flops, _ = update_flops(model)
        out.append((label, base_flops / model_flops, paper, base_flops, model_flops))
    return out


def main() -> None:
    print(f"{'row':40s} {'ours':>6s} {'paper':>6s} {'baseline PFLOP':>15s} "
          f"{'model PFLOP':>12s}   (per update)")
    for label, ours, paper, base_flops, model_flops in rows():
        print(f"{label:40s} {ours:5.2f}x {paper:5.2f}x {base_flops / 1e15:15.2f} "
              f"{model_flops / 1e15:12.2f}")


if __name__ == "__main__":
    main()
