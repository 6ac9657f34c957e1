"""``python -m tests.fakes.skewed_clock SECONDS ARGS...``: the ``inferq`` command with this
process's wall clock shifted by SECONDS (``time.time`` and ``time.time_ns``).

The clock-skew test's stand-in for a host whose clock is wrong. libfaketime cannot serve
here: with its monotonic clock real (``DONT_FAKE_MONOTONIC=1``) libfaketime 0.9.10 makes
Python's ``time.sleep`` fail with EINVAL, and with it shifted too every timed wait of a
thread (``Event.wait``) lasts the shift longer.
"""

from __future__ import annotations

import sys
import time


def main() -> None:
    skew_s = float(sys.argv[1])
    real, real_ns = time.time, time.time_ns
    time.time = lambda: real() + skew_s
    time.time_ns = lambda: real_ns() + round(skew_s * 1e9)
    sys.argv = ["inferq", *sys.argv[2:]]
    from inferq.cli.main import main as inferq_main

    inferq_main()


if __name__ == "__main__":
    main()
