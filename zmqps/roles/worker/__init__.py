"""The worker role: the synchronous API for training loops and the built-in program.

worker.py   Worker: composes the session, the step mode and the parameter client
session.py  Session: chief connection, identity, generation, heartbeats, the one
            recovery policy (also the evaluator's)
modes.py    the consistency mode as a strategy: async, ssp (clock), sync (tokens)
train.py    the built-in training program
"""

from zmqps.roles.worker.session import RunEnded, Session
from zmqps.roles.worker.train import train
from zmqps.roles.worker.worker import Terminated, Worker, WorkerOptions

__all__ = ["RunEnded", "Session", "Terminated", "Worker", "WorkerOptions", "train"]
