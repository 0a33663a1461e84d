"""What keeps a run alive or stops it cleanly: preemption signals, the hang watchdog and the
last-collective record, non-finite and loss-spike guards, and the test-only fault plan."""
