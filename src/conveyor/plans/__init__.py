"""Plans: the schedules of pipelines, warp-specialized pipelines and ring collectives as pure data.

A leaf package: of Conveyor it imports only `_compat` (Pallas's private types) and `jaxprs`
(which grid indices an index map reads). Each plan states its rules
(usable on Python and traced ints, for the lowerings and the XLA executor) and emits its whole
schedule as an event program (`program.Program`), which the checker and the simulator interpret.
"""
