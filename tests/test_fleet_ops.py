"""make fleet's plan (serve/ops/fleet.py) and make fleet-check's pieces, without starting
anything: ports per pod, the sidecars' fleet flags, shared files, the bad candidate."""
from __future__ import annotations

from pathlib import Path

import pytest

from serve.errors import ConfigError
from serve.ops.fleet import FleetPlan, drain_records, pod_config, table
from serve.ops.fleet_check import newest_shuffled
from serve.ops.launch_ports import planned_ports
from serve.ops.launch_processes import sidecar_command
from tests.fixtures.sidecar import add_versions


def test_every_pod_has_its_own_ports_and_folders_and_shares_the_rest():
    plan = FleetPlan(pods=3)
    cfgs = [pod_config(plan, i) for i in range(3)]
    ports = [u.port for c in cfgs for u in planned_ports(c)]
    assert len(ports) == len(set(ports)) == 24  # 3 pods x 8 ports (5 TorchServe, 3 sidecar)
    assert (cfgs[0].inference_port, cfgs[0].sidecar_port, cfgs[0].sidecar_write_port) == (
        8180, 8190, 8191)
    assert len({c.path(c.run_dir) for c in cfgs}) == 3
    assert len({c.path(c.model_store) for c in cfgs}) == 3  # derived archives per pod
    assert {c.repository_dirs[0] for c in cfgs} == {plan.path(plan.model_store)}
    assert {c.path(c.state_file) for c in cfgs} == {plan.path(plan.state_file)}
    assert {c.token_file for c in cfgs} == {plan.path(plan.run_dir) / "sidecar-token"}
    cmd = sidecar_command(cfgs[1])
    at = cmd.index("--fleet")
    assert cmd[at:] == ["--fleet", "file", "--fleet-identity", "pod-2", "--fleet-dir",
                        str(plan.path(plan.run_dir))]
    assert table(plan).splitlines()[2].split()[:4] == [
        "pod-2", "http://127.0.0.1:8280/predictions/dlrm", "http://127.0.0.1:8290",
        "http://127.0.0.1:8291"]


@pytest.mark.parametrize(("kw", "message"), [
    ({"pods": 0}, "pods=0 must be 1..9"),
    ({"workers": 0}, "workers=0 must be 1..8 per pod"),
    ({"base_port": 65400}, "base_port=65400: the pods' ports would run past 65535"),
])
def test_a_bad_plan_is_refused(kw, message):
    with pytest.raises(ConfigError, match=message):
        FleetPlan(**kw)


def test_the_bad_candidate_is_the_newest_shuffled_version(tmp_path):
    store = add_versions(tmp_path / "repo", ["small-s0", "small-s1-shuffled", "small-s2"])
    assert newest_shuffled(store) == "small-s1-shuffled"
    assert newest_shuffled(add_versions(tmp_path / "none", ["small-s0"])) is None


def test_the_fleet_clears_the_drain_file_each_sidecar_reads():
    """make fleet after make fleet-down: each pod's sidecar is started with --drain-file
    (what it reads at start); the fleet must clear that very file, or every pod stays
    drained ("drained for shutdown before the sidecar restarted") and never turns ready."""
    plan = FleetPlan(pods=2)
    for i in range(plan.pods):
        cfg = pod_config(plan, i)
        cmd = sidecar_command(cfg)
        read = Path(cmd[cmd.index("--drain-file") + 1])
        cleared = drain_records(cfg)
        assert read in cleared
        assert cfg.delta_dir / ".drained.json" in cleared  # where older sidecars wrote it
