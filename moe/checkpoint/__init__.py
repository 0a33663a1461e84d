"""The checkpoint format, below everything that reads or writes checkpoints.

A checkpoint is the directory ``<run>/checkpoints/step_NNNNNNN`` holding DeepSpeed's files (the
model states ``mp_rank_00_model_states.pt``, the ZeRO optimizer partition of every rank, and in
``experts/`` one file per expert of every MoE layer), the RNG state of each rank, the resolved
run config, a copy of the tokenizer and, written last, the completion marker ``checkpoint.json``
(format version, step, layout, every file's size, expert fingerprints).

- :mod:`moe.checkpoint.files`: names, the marker, finding and verifying checkpoints;
- :mod:`moe.checkpoint.fingerprints`: identifying each expert's weights on any layout;
- :mod:`moe.checkpoint.consolidate`: reading any expert-parallel layout into single-device tensors.

Everything here is file work: writing a checkpoint (collective) is the trainer's
(:mod:`moe.training.checkpoint`), gathering fingerprints across ranks the DeepSpeed adapter's.
"""
