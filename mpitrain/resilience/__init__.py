"""Surviving faults: injected faults for tests and demos, watchdog, heartbeats, bad-step guards, replica checks."""
