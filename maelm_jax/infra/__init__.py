"""The infrastructure every layer stands on: errors, paths (local and cloud), the
environment, processes and their barriers, caches, host memory, the command line, meshes
and sharding rules, compile-only TPU topologies, the timer and the records of
measurements (commit, machine)."""
