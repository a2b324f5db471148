"""zmqps' version, in a module of its own so that low layers (the metrics'
``zmqps_build_info``, an export's ``signature.json``) can read it without
importing the package root, which imports the roles."""

__version__ = "0.1.0"
