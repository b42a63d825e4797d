"""The end-to-end demo (`tether demo`): a control plane, engines with agents, and a trainer.

`local_fleet` brings up the demo's services in order (processes through `launcher.processes`),
`task` is the verifiable task (sums of two digits) and its reward, `trainer` the GRPO loop,
`report` the live table and the summary, `run` ties them together.
"""
