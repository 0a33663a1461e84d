"""Training: the DeepSpeed engine and the loop (trainer.py: a TrainState the loop owns, the step,
then its parts, one LoopPart base (hooks.py): meters, the router balance, the guards' decisions,
reporters; and the loop's own saves, rollbacks and exits), saving and resuming every registered
state on any layout; ``resilience/`` holds preemption, the watchdog, the guards and fault
injection."""
