"""The streaming runtime: the hot path, passes, the resident window, policies, reports."""
