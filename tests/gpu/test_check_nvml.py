"""tests/gpu/check_nvml.py under pytest: skipped on a machine without an NVIDIA GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .check_nvml import NO_GPU, gpu_uuids

SCRIPT = Path(__file__).with_name("check_nvml.py")


def test_nvml_is_measured_per_beat_mapped_by_uuid_and_refuses_what_cannot_fit() -> None:
    found = gpu_uuids()
    if isinstance(found, str):
        pytest.skip(f"no GPU: {found}")
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--json"], capture_output=True, text=True, timeout=300
    )
    assert run.returncode != NO_GPU, run.stderr
    assert run.returncode == 0, run.stderr
    figures = json.loads(run.stdout)
    assert figures["uuid"] == found[-1]
    assert figures["free_mib_before"] - figures["free_mib_with_1gib_taken"] >= 1024
