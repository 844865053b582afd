"""The sidecar's side of embedding deltas (:mod:`~serve.sidecar.services.deltas.intake`)."""
