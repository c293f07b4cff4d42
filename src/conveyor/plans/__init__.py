"""Plans: the schedules of pipelines, warp-specialized pipelines and ring collectives as pure data.

A leaf package: it imports no other Conveyor module but `_compat`. Each plan states its rules
(usable on Python and traced ints, for the lowerings and the XLA executor) and emits its whole
schedule as an event program (`program.Program`), which the checker and the simulator interpret.
"""
