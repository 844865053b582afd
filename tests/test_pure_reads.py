"""Reads change nothing: GET /state, GET /metrics, GET /tuner and the served versions
(what a delta's validation and the metric collectors ask) read the reconciler's snapshot.

Only the reconciler's pass acts: it reads the desired-state file, declares a rollout,
resets the retry back-off. Here a rollout is declared and the first pass has run; then
the file changes on disk (as a ConfigMap update does) without waking the reconciler, and
the read paths are called several times. The reconciler's and the rollout controller's
state must be what it was, and no asyncio task may have started. (Before this was so,
``GET /state`` re-read the file and declared the new rollout: a read replacing the
controller's run while the reconciler's task could be evaluating it on a thread.)

TorchServe is faked (:class:`tests.fixtures.sidecar.FakeTorchServe`): it is not ours.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel

from serve.sidecar.config import SidecarConfig
from serve.sidecar.http.app import create_app
from serve.sidecar.root import Sidecar
from serve.state import Batching, DesiredState, ModelRef, Rollout, write_state
from serve.store.repository import ModelRepository
from tests.fixtures.sidecar import FakeTorchServe, add_versions

MGMT = "http://ts-management"
TOKEN = "t0ken-for-tests-t0ken-for-tests-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _declared(weight: float) -> DesiredState:
    return DesiredState(model=ModelRef(version="small-s0"),
                        batching=Batching(batch_size=8, max_batch_delay_ms=50), workers=1,
                        rollout=Rollout.model_validate({"candidate": "small-s1",
                                                        "weight": weight, "bake_s": 600}))


_PLAIN = (type(None), bool, int, float, str, bytes, BaseModel)


def _plain(value: Any) -> bool:
    if isinstance(value, _PLAIN) or (dataclasses.is_dataclass(value)
                                     and not isinstance(value, type)):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


def dump(obj: object) -> dict[str, Any]:
    """``obj``'s attributes: data deep-copied (compared by value), everything else (a
    client, a clock, an event, a lock) by identity (compared as "not replaced")."""
    return {name: copy.deepcopy(value) if _plain(value) else ("object", id(value))
            for name, value in sorted(vars(obj).items())}


def test_reads_change_nothing(tmp_path: Path) -> None:
    repo = ModelRepository([add_versions(tmp_path / "repo", ["small-s0", "small-s1"])])
    state_file = tmp_path / "state" / "state.yaml"
    write_state(state_file, _declared(0.1))
    ts = FakeTorchServe(tmp_path / "store")
    config = SidecarConfig(
        management_url=MGMT, metrics_url=MGMT, token=TOKEN, model_store=ts.store,
        switch_grace_s=0.0, state_file=state_file, repositories=tuple(repo.roots),
        cgroup_root=tmp_path / "no-cgroup", delta_dir=tmp_path / "deltas",
        # Long: after the first pass only a wake-up (none here) runs another.
        reconcile_interval_s=600.0)
    app = create_app(config, http_client=httpx.AsyncClient(transport=ts.transport()))
    sidecar: Sidecar = app.state.sidecar

    async def go() -> None:
        async with app.router.lifespan_context(app):
            reconciler = sidecar.reconciler
            assert reconciler is not None and reconciler.rollouts is not None
            for _ in range(500):  # the first pass: switch to the two-arm registration
                if reconciler.last_pass is not None and reconciler.last_pass.converged:
                    break
                await asyncio.sleep(0.02)
            assert reconciler.last_pass is not None and reconciler.last_pass.converged
            run = reconciler.rollouts.run
            assert run is not None and run.spec.weights() == [0.1]
            # The file changes on disk; nothing wakes the reconciler.
            write_state(state_file, _declared(0.5))
            before = (dump(reconciler), dump(reconciler.rollouts), asyncio.all_tasks(),
                      dump(reconciler.passes), dump(reconciler.runner))
            transport = httpx.ASGITransport(app=app)
            responses, served = [], []
            async with httpx.AsyncClient(transport=transport, base_url="http://sc") as c:
                for _ in range(3):
                    responses += [await c.get(url) for url in ("/state", "/metrics", "/tuner")]
                    served.append(sidecar.served_versions())
            after = (dump(reconciler), dump(reconciler.rollouts), asyncio.all_tasks(),
                     dump(reconciler.passes), dump(reconciler.runner))
            assert after[0] == before[0]
            assert after[1] == before[1]
            assert after[2] == before[2], "a read started a task"
            assert after[3] == before[3]  # the passes' record (PassLog)
            assert after[4] == before[4]  # the back-off and the last switch (SwitchRunner)
            assert reconciler.rollouts.run is run
            assert [r.status_code for r in responses] == [200] * 9, responses[0].text
            # What the last pass read: the file's change waits for the next pass.
            assert {tuple(r.json()["rollout"]["weights"]) for r in responses[::3]} == {(0.1,)}
            assert served == [["small-s0", "small-s1"]] * 3

    asyncio.run(go())
