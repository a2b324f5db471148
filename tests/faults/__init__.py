"""A seeded, randomized fault harness for zmqps clusters, in the style of Jepsen.

One integer seed gives a schedule (:mod:`faults.schedule`): a mode, a cluster, and
1-4 faults at points of training. The harness starts that cluster as processes
(:mod:`faults.cluster`, which also restarts killed tasks as a supervisor does),
injects the faults from outside the product (:mod:`faults.inject`: signals and
network-namespace firewall rules), watches the chief's status (:mod:`faults.probe`,
:mod:`faults.observe`), and checks invariants on what the run left
(:mod:`faults.invariants`) against the unfaulted run of the same configuration
(:mod:`faults.runner`). :mod:`faults.report` runs and reports; ``bin/faults`` (python
-m faults) is the command, tests/cluster/test_fault_schedules.py the fixed seeds.
"""
