"""Sparse Mixture-of-Experts decoder language models trained with DeepSpeed.

Layers, every import pointing down: foundations (``errors``, ``config_schema``, the checkpoint
format ``checkpoint/``) <- the single-device model (``model/``) <- parallelism and training
(``parallel/``, ``training/``) <- evaluation and tools (``evaluation/``, ``tools/``) <- the
command lines in ``launch/``. ``data_pipeline/`` stands beside the model.
"""

import logging as _logging


class _NoCpuFallbackNotice(_logging.Filter):
    """DeepSpeed announces "Setting accelerator to CPU" in every process that imports it on a
    machine without CUDA. Our entry points say once which device and backend a run uses
    (``moe-train`` logs it on rank 0), so the per-process notice is dropped."""

    def filter(self, record: _logging.LogRecord) -> bool:
        return "Setting accelerator to CPU" not in record.getMessage()


_logging.getLogger("DeepSpeed").addFilter(_NoCpuFallbackNotice())
