"""Training: the DeepSpeed engine and the loop, hooks around the step (checkpoints,
TensorBoard, throughput), resuming on any layout; ``resilience/`` holds preemption, the
watchdog, the guards and fault injection."""
