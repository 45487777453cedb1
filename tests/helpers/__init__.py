"""Helpers shared by the tests: job builders and child-process scripts."""
