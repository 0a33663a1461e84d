"""Single-device model code for sparse Mixture-of-Experts decoder language models.

Shape legend used across the hot code: ``B`` batch, ``S`` sequence length, ``T`` tokens (B*S),
``D`` model width, ``H`` expert hidden width, ``E`` experts, ``K`` experts per token (top-k),
``N`` routed token copies, ``V`` vocabulary.
"""
