"""Glue a deployment names in its instance config (the Ray run launcher of deploy/ray)."""
