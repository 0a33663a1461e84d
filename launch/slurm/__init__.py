"""Everything SLURM: the batch job script (``script``), the checks before a submission
(``checks``), the job records and what SLURM says about a job (``jobs``), and the preparation of
data as SLURM jobs (``prepare``). What runs inside the allocation is ``python -m
launch.supervise slurm``: the same restart policy as every other scheduler (launch/supervise.py)."""
