"""The chief role.

service.py      ChiefService: the op table over the parts below, status and its blocker
modes.py        the consistency mode as a strategy: async, ssp, sync (tokens, the global step)
recovery.py     RecoveryController: phase, PS health, generations, restores, adoption,
                worker admission (fencing, where a new incarnation resumes)
variables.py    variable creation and the placement
checkpoints.py  when checkpoints are taken
done_record.py  the workers that finished, on disk (a restarted chief reads them)
finish.py       the summary, the final model's evaluation and export
serve.py        the chief as a process, and the order of the end of a run
"""

from zmqps.roles.chief.serve import run_chief, serve_chief
from zmqps.roles.chief.service import ChiefService
from zmqps.roles.configs import ChiefConfig

__all__ = ["ChiefConfig", "ChiefService", "run_chief", "serve_chief"]
