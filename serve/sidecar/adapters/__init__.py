"""What the sidecar talks to outside itself: TorchServe's management API, model archives,
cgroup memory, NVIDIA GPUs (NVML), the write token's file and the versions' schemas in the
model store. Imports neither the controllers nor the HTTP edge."""
