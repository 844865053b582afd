"""The review's N1 against the real processes: a flood of the OIP port (stalled 8 MiB - 1
byte uploads and bad 8 MiB bodies) never reaches the sidecar's probes or TorchServe's
predict, the OIP refuses its excess fast and stays alive. ``make oip-flood`` runs the
same :func:`bench.oip_flood.run_flood` for 60 s under the pod's cgroup limits."""
from __future__ import annotations

import psutil
import pytest

from bench.oip_flood import oip_child, run_flood, vm_hwm_bytes

pytestmark = pytest.mark.integration

SECONDS = 12


def test_a_flood_of_the_oip_port_leaves_the_probes_and_8080_alone(sidecar, torchserve):
    oip = oip_child(sidecar.proc.pid)
    result = run_flood(sidecar.oip_url, sidecar.url, torchserve.predict_url,
                       seconds=SECONDS, stallers=150, posters=8)
    s = result.summary()
    # The sidecar's probes: every one answered 200 within the probe's 2 s timeout.
    for probe in ("readyz", "healthz"):
        assert s[probe]["n"] >= SECONDS, s[probe]
        assert s[probe]["timeouts"] == 0 and s[probe]["failures"] == 0, s
    # TorchServe's predict on 8080 kept answering 200.
    assert s["predict"]["failures"] == 0 and s["predict"]["ok"] > 0, s
    # Excess OIP requests were refused (429), fast; the stalled ones got 408 at the
    # deadline; bad bodies parsed got 400; never a 5xx but the refusals.
    answers = s["oip_answers"]
    assert answers.get("429", 0) > 100, answers
    assert not {k for k in answers if k.startswith("5") and k != "503"}, answers
    # Fast: answered on the headers, before the body. The bound here is loose because
    # this 2-core machine is shared (load average ~10 measured); make oip-flood reports
    # the p99 against the 100 ms goal with the machine it ran on.
    for lat in (s["oip_refusal_latency"], s["oip_refusal_probe"]):
        assert lat["p50_ms"] < 1000 and lat["p99_ms"] < 3000, lat
    # The same processes, alive; the OIP's memory stayed under its container's 512 MiB.
    for pid in (sidecar.proc.pid, oip):
        assert psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
    assert oip_child(sidecar.proc.pid) == oip
    assert vm_hwm_bytes(oip) < 512 * 2**20
