"""Operations tools run by people and make targets, on a workstation or CI.

launcher (``make run`` / ``up`` / ``down``), capacity (``make capacity``: one pod's knee),
hpa_sim (``make hpa-sim``), knee (the one knee rule shared by capacity, the load-test
report and the end-to-end benchmark).
"""
