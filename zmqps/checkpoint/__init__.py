"""Checkpoints: every PS writes its shards' files into a shared root, the chief commits.

Layer map: core <- checkpoint <- roles / cli. This package does file IO only (no
sockets, no threads): :mod:`~zmqps.checkpoint.format` is the file format (shard
files, manifest), :mod:`~zmqps.checkpoint.root` the directory protocol (temp
directories, atomic commit, ``LATEST``, pruning, verification, resharding reads).
"""

from zmqps.checkpoint.format import (
    FORMAT_VERSION,
    MODES,
    CheckpointError,
    Manifest,
    ShardContents,
    ShardRecord,
    read_shard_file,
    sha256_file,
    shard_file_name,
    write_shard,
)
from zmqps.checkpoint.root import (
    LATEST,
    MANIFEST,
    Checkpoint,
    CheckpointRoot,
    committed_name,
    is_valid_name,
    step_of,
)

__all__ = [
    "FORMAT_VERSION",
    "LATEST",
    "MANIFEST",
    "MODES",
    "Checkpoint",
    "CheckpointError",
    "CheckpointRoot",
    "Manifest",
    "ShardContents",
    "ShardRecord",
    "committed_name",
    "is_valid_name",
    "read_shard_file",
    "sha256_file",
    "shard_file_name",
    "step_of",
    "write_shard",
]
