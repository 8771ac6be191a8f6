"""The infrastructure every layer stands on: errors, paths (local and cloud), the
environment, processes and their barriers, caches, host memory, the command line, meshes
and sharding rules, compile-only TPU topologies, the timer, the records of measurements
(commit, machine) and the Markdown tables every report is written in."""
