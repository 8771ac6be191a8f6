"""A run's workdir: its layout (every file name, config.json) and the guard that refuses a
workdir not ours and restores one a refused run touched."""
