"""Everything SLURM: the batch job script (``script``), the checks before a submission
(``checks``), the job records and what SLURM says about a job (``jobs``), the preparation of
data as SLURM jobs (``prepare``) and the runs of a scaling sweep as SLURM jobs (``sweep``). What
runs inside the allocation is ``python -m launch.supervise slurm``: the same restart policy as
every other scheduler (launch/restarts.py)."""
