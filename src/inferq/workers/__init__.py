"""GPU worker processes: heartbeats, batch execution on a model server, drain."""
