"""Scheduling policies as pure logic (no I/O): the workers and the simulator drive the same code."""
