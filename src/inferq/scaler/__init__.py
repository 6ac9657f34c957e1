"""The scaler daemon: desired workers per model, started and drained on a platform."""
