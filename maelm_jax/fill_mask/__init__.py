"""Fill-mask: what a pretrained model predicts for the <mask> pieces of any text (run.py),
and its config as plain data (config.py)."""
