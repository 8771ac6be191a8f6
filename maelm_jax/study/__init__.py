"""The laptop-scale study: MLM, MAE-LM and 3ML pretrained alike, analysed and fine-tuned."""
