"""Running the passes around a captured graph: the context they run in, peak calibration, the
measured choice between plans, and the batch-size search."""
