"""Runnable examples (`python examples/<name>.py`): Tether under the trainers people use.

Each example composes a local fleet from `demo/` and a trainer framework; nothing imports
`examples/`, and an example must never hold logic a library user would need (that belongs
in `trainer_client/`).
"""
