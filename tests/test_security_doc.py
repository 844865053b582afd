"""SECURITY.md says what the manifests open (review N11): its ports table lists every port
k8s/networkpolicy.yaml admits, and says "any pod in the cluster" exactly for the ports of
rules without a ``from``; its threat model names each such port among what an in-cluster
attacker reaches; the Dockerfile's EXPOSE lists every port a container declares. Parsed,
never run (like tests/test_docs_commands.py)."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SECURITY = (REPO / "SECURITY.md").read_text()
ANYWHERE = "any pod in the cluster"


def _ingress_rules() -> list[dict]:
    docs = [d for d in yaml.safe_load_all((REPO / "k8s" / "networkpolicy.yaml").read_text())
            if d]
    return [r for d in docs if "Ingress" in d["spec"].get("policyTypes", [])
            for r in d["spec"].get("ingress", [])]


def _section(title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", SECURITY, re.MULTILINE | re.DOTALL)
    assert m, f"SECURITY.md has no section '## {title}'"
    return m.group(1)


def _table() -> dict[int, str]:
    """The ports table: port -> its row (a row may name two ports: ``7070 / 7071``)."""
    rows: dict[int, str] = {}
    for line in _section("Ports and who reaches them").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells and re.fullmatch(r"[\d /]+", cells[0]):
            for port in re.findall(r"\d+", cells[0]):
                rows[int(port)] = line
    return rows


def _open_ports() -> set[int]:
    return {p["port"] for r in _ingress_rules() if not r.get("from") for p in r["ports"]}


def test_the_ports_table_lists_every_port_the_networkpolicy_admits():
    admitted = {p["port"] for r in _ingress_rules() for p in r["ports"]}
    table = _table()
    assert admitted <= set(table), f"not in SECURITY.md's table: {admitted - set(table)}"
    for port, row in table.items():
        assert (ANYWHERE in row) == (port in _open_ports()), \
            f"{port}: says '{ANYWHERE}' iff a rule without `from` admits it: {row}"


def test_the_threat_model_names_every_port_open_to_the_cluster():
    open_ports = _open_ports()
    assert open_ports, "some port is open to the cluster (inference)"
    bullet = next(b for b in _section("Threat model").split("\n- ")
                  if "in-cluster attacker" in b)
    first = bullet.split(". ")[0] + ". " + bullet.split(". ")[1]
    named = {int(n) for n in re.findall(r"\b(\d{4})\b", first)}
    assert open_ports <= named, (
        f"the threat model's in-cluster attacker reaches {sorted(open_ports)}; SECURITY.md "
        f"names {sorted(named)} in: {first!r}")


def test_the_image_exposes_every_container_port():
    docs = [d for d in yaml.safe_load_all((REPO / "k8s" / "deployment.yaml").read_text()) if d]
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    declared = {p["containerPort"] for c in deploy["spec"]["template"]["spec"]["containers"]
                for p in c.get("ports", [])}
    m = re.search(r"^EXPOSE\s+(.+)$", (REPO / "Dockerfile").read_text(), re.MULTILINE)
    assert m, "the Dockerfile has no EXPOSE"
    exposed = {int(p.split("/")[0]) for p in m.group(1).split()}
    assert exposed == declared, f"EXPOSE {sorted(exposed)} vs containerPorts {sorted(declared)}"
