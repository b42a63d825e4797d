"""Child processes for whoever starts them: the demo, the CLI, the Modal replicas, the GPU
check, the benchmarks and the tests (`launcher.processes`).

Imports nothing of Tether, so everything above it may use it without a cycle.
"""
