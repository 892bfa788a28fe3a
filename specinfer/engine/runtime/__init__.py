"""Running a model on a device: loading, the runner that makes tensors, backends, parallelism."""
