"""Plans: the schedules of pipelines, warp-specialized pipelines and ring collectives as pure data.

Design notes: docs/internals/plans.md, section `plans/__init__.py`.
"""
