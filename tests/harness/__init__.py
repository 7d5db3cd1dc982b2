"""Test harnesses shared by several test folders (namespaced hosts, a throw-away Slurm)."""
