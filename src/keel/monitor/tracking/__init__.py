"""The experiment trackers' clients, one module each, found by keel.monitor.tracking.registry."""
