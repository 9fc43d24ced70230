"""One way for a test to wait on something another process does: poll a check until it holds."""

import time


def eventually(check, seconds, interval=0.2, *, message):
    """Call `check` until it returns something truthy and return that, or fail after `seconds`
    with `message` (a string, or a callable for one that reports the state at the deadline)."""
    deadline = time.monotonic() + seconds
    while True:
        found = check()
        if found:
            return found
        # Checked after the call, so a check that is slow to answer still gets a last try.
        if time.monotonic() >= deadline:
            raise AssertionError(f"{message() if callable(message) else message} (waited {seconds} s)")
        time.sleep(interval)
