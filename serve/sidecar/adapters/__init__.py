"""What the sidecar talks to outside itself: TorchServe (its management and metrics APIs),
the model archives it derives, cgroup memory, NVIDIA GPUs (NVML), the write token's file,
the versions' schemas in the model store, and the fleet's lease, decisions and peers (in
files or through the Kubernetes API). Of the sidecar, adapters import only
:mod:`serve.sidecar.config`, which imports none of its layers: no controller, service or
HTTP route is loaded by importing an adapter."""
