"""Weights as one single-device model: a checkpoint of ours in any parallel layout (load) or a
Hugging Face transformers directory (hf). Above the model and the configs, below training,
evaluation and tools."""
