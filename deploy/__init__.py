"""Recipes that place Tether on infrastructure: the Modal app, one replica's command lines,
fleet plans (TOML), Kubernetes manifests and the GPU check.

Imports the packages it deploys; no package imports it except the `tether` CLI (`cli/`),
which exposes `tether deploy`.
"""
