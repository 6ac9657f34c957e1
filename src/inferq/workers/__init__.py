"""GPU worker processes: heartbeats, batch execution through a backend, drain."""
