"""Trace-replay benchmark: traces, backends, measurement, reports."""
