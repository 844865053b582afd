"""The sidecar's side of embedding deltas: take one in, wait for the workers, report them.

Separate parts, each owning its state and handing the next values (wired once in
:mod:`serve.sidecar.root`, handed to the routes as
:class:`~serve.sidecar.services.deltas.parts.DeltaParts`):

* :mod:`~serve.sidecar.services.deltas.intake`: :class:`DeltaIntake` checks a delta
  (size, the store's room, the served versions and their tables) and commits it to the
  store (:mod:`serve.store.deltas.files`); it counts refusals and skipped volume files,
  and keeps the stored deltas' id changes (:mod:`~serve.sidecar.services.deltas.idmaps`).
* :mod:`~serve.sidecar.services.deltas.volume`: :class:`VolumeSync` takes the deltas
  published on the model volume through the intake (one chain per fleet).
* :mod:`~serve.sidecar.services.deltas.progress`: :class:`WorkerProgress` knows the live
  workers and what they applied: the wait of a POST and the readiness latch. The only
  part bound to the event loop.
* :mod:`~serve.sidecar.services.deltas.report`: :class:`DeltaReport` reads the store,
  the progress and the intake's counts: summaries, damaged files, metrics.
* :mod:`~serve.sidecar.services.deltas.cleanup`: deleting the folders of versions no
  longer served.

Walk of a delta: intake -> store -> the workers' follower (:mod:`serve.runtime.follower`)
-> their status files -> progress and report.
"""
