"""Conversion and sizing tools that run on one process outside training: exporters
(fp32, Hugging Face, one-rank DeepSpeed) and the memory planner behind ``moe-plan``."""
