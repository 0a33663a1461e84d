"""Training: the DeepSpeed engine and the loop (trainer.py: a TrainState the loop owns, the step,
then meters, the guards' decisions, observers, and the loop's own saves, rollbacks and router-bias
update), saving and resuming on any layout; ``resilience/`` holds preemption, the watchdog, the
guards and fault injection."""
