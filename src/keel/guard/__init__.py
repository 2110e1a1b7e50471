"""Guards: per-step checks of the run's math that skip an update, roll back, stop, or quarantine a rank."""
