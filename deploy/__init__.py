"""The composition root: the `tether` CLI, the local launcher, deployment recipes.

Imports every other package; no package imports it.
"""
