"""Single-device model code for sparse Mixture-of-Experts decoder language models.

Shape legend used across the hot code: ``B`` batch, ``S`` sequence length, ``T`` tokens (B*S),
``D`` model width, ``H`` expert hidden width, ``E`` experts, ``K`` experts per token (top-k),
``N`` routed token copies, ``V`` vocabulary.
"""

import logging as _logging


class _NoCpuFallbackNotice(_logging.Filter):
    """DeepSpeed announces "Setting accelerator to CPU" in every process that imports it on a
    machine without CUDA. Our entry points say once which device and backend a run uses
    (``moe-train`` logs it on rank 0), so the per-process notice is dropped."""

    def filter(self, record: _logging.LogRecord) -> bool:
        return "Setting accelerator to CPU" not in record.getMessage()


_logging.getLogger("DeepSpeed").addFilter(_NoCpuFallbackNotice())
