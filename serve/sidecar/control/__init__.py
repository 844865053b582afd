"""The sidecar's controllers, each a state machine with steps you can call one by one:
the reconciler (the one writer of TorchServe's registrations), the version switch, the
rollout and its guards, the batching tuner and the drain. Imports adapters; never the HTTP
edge."""
