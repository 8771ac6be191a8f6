"""Analyses of trained encoders (the MAE-LM paper's effective rank, Fig. 1 and Table 3)."""
