"""Command line: ``zmqps``, ``zmqps-server``, ``zmqps-worker`` (the top layer).

A regular package (not a namespace directory) so that the import contracts in
pyproject.toml see its modules.
"""
