"""Evaluating checkpoints on one process: loss and perplexity, expert statistics, generations,
and the report that compares checkpoints."""
