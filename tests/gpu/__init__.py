"""Checks that need a real GPU (skipped without one)."""
