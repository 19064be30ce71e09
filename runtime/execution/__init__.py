"""Running a captured or rewritten graph: the backends (eager, Inductor, CUDA graphs), phase-bounded
fusion, the swap kernels and their recorded forms, and the bound training step."""
