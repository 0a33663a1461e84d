"""Adapters: small trainable modules added to a trained model for fine-tuning (LoRA). Model code
like the rest of ``moe/model``: single-device, no ranks, no engine; the trainer decides which
parameters train (moe/training/finetune.py)."""
