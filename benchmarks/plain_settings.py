"""The plain settings: what a run takes for every setting left to the device
(``RunConfig.device_choices``) on the CPU, and took on CUDA too before CUDA runs got their own:
eager blocks, the full loss, the scatter-add permutation, three query, key and value products,
torch's foreach AdamW (torch's own choice on CUDA) and DeepSpeed's own gradient handling. The GPU proof's second bench pass and
the settings matrix's ``eager`` setting run them: the baseline the CUDA defaults are measured
against. Standard library only (the proof imports it before anything is installed)."""

EAGER = (
    "train.compile=false",
    "train.immediate_grad_update=false",
    "train.flat_grad_ops=false",
    "train.optimizer_impl=foreach",
    "model.cross_entropy=full",
    "model.moe.permute=index_add",
    "model.qkv_projection=separate",
)
"""``--set`` overrides that give the plain settings on any device."""
