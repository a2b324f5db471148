"""Roles: the PS, chief, worker and evaluator processes, built from transport + core.

A regular package (not a namespace directory) so that the import contracts in
pyproject.toml see its modules.
"""
