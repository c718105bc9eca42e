"""Sampling and verification: the leaf both the drafters and the core decode with (numpy only, no model)."""
