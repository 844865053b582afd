"""Operations tools run by people and make targets, on a workstation or CI.

launcher (``make run`` / ``up`` / ``down``; its parts: ``launch_config``,
``launch_ports``, ``launch_processes``, ``launch_state``, ``process_groups``), capacity
(``make capacity``: one pod's knee), hpa_sim (``make hpa-sim``), knee (the one knee rule
shared by capacity, the load-test report and the end-to-end benchmark). The generator
``monitoring`` renders ``monitoring_rules``, ``monitoring_dashboard`` and
``monitoring_adapter``; ``import_check`` runs its steps from the ``import_check_*`` modules.
"""
