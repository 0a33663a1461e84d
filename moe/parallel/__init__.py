"""Parallelism applied from outside the single-device model: the one adapter that knows
DeepSpeed's MoE conventions, expert-parallel process groups and the all-to-all dispatcher."""
