"""Core (sans-IO): pure state of a parameter server and its coordination.

Layer map: wire <- core <- roles. Nothing here touches sockets, threads, clocks
(time is passed in) or the environment (an import contract in pyproject.toml keeps
such modules out).
"""
