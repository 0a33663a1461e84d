"""The foundations every layer may import: errors, config-from-dict (config_schema), atomic
file I/O (fileio) and the run directory's names (run_dir). They import nothing of the project."""
