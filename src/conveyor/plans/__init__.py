"""Plans: the schedules of pipelines, warp-specialized pipelines and ring collectives as pure data.

A leaf package: of Conveyor it imports only `_compat` (Pallas's private types) and `jaxprs`
(which grid indices an index map reads). `specs` reads Pallas block specs in the plans' terms;
the plans themselves (`pipeline`, `warp`, `sequence`, `ring`) hold no Pallas front end. Each plan
states its rules
(usable on Python and traced ints, for the lowerings and the XLA executor) and emits its whole
schedule as an event program (`program.Program`), which the checker and the simulator interpret.
"""
