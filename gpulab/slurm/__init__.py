"""A real Slurm (Debian's slurmctld, slurmd and munge) over lab hosts, and its pytest fixture."""
