"""The single-device model: config, norms, positions, attention, router, dispatcher, experts,
MoE layer, block, transformer, generation. Nothing here knows about ranks, process groups,
training or checkpoints.

Shape legend used across the hot code: ``B`` batch, ``S`` sequence length, ``T`` tokens (B*S),
``D`` model width, ``H`` expert hidden width, ``E`` experts, ``K`` experts per token (top-k),
``N`` routed token copies, ``V`` vocabulary.
"""
