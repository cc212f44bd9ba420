"""Facts about the process and the machine: messages said once per job, host memory limits, versions, the CUDA runtime."""
