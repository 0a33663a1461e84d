"""Training: the run config, the DeepSpeed engine and loop, hooks around the step (checkpoints,
TensorBoard, preemption, non-finite guards), resuming on any layout, and loading a checkpoint
as one model."""
