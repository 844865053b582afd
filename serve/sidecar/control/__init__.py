"""The sidecar's controllers, each a state machine with steps you can call one by one:
the reconciler (the one writer of TorchServe's registrations; its parts: the
desired-state file, the assessment, the switch runner, the rollout stepper), the version
switch, the rollout and its guards, the batching tuner and its loop, PUT /batching's
updates and the drain.
Every phase is a ``StrEnum`` of :mod:`~serve.phases`. Reads of a
controller (its status) are pure: only its own step changes it. Imports adapters; never
the HTTP edge."""
