"""The scaler daemon: desired workers per model, started and drained through a backend."""
