"""The run directory: its event log and messages, status, lock and quarantine list. What a run leaves
on disk for the next start, `keel status` and the operators to read."""
