"""Retraining with a fixed mask: the one-shot + fine-tuning baselines and the dense control (``--finetune``)."""
