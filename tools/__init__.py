"""mutwo's command-line tools: mutwo-opt, configs, workloads and reports."""
